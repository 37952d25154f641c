"""benchmarks/rollout_gateway.py's pure parts (no run): where a pool round's time went, read from the
processor's trace spans and the gateway's recorded latency, and repeat.py's figures of a result."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import repeat  # noqa: E402
import rollout_gateway  # noqa: E402


@dataclass
class Call:
    latency_s: float


@dataclass
class Result:
    calls: list[Call]
    spans: list[dict[str, Any]] = field(default_factory=list)


def rollout(start_s: float, call_start_s: float, call_end_s: float, gateway_s: float) -> Result:
    """A one-call rollout whose processor starts `start_s` after the round (at wall time 100 s)."""
    ns = lambda s: int((100.0 + s) * 1e9)  # noqa: E731
    spans = [
        {"name": "OneCall", "parent_span_id": None, "start_ns": ns(start_s), "end_ns": ns(call_end_s)},
        {"name": "llm.call", "parent_span_id": "p", "start_ns": ns(call_start_s), "end_ns": ns(call_end_s)},
    ]
    return Result([Call(gateway_s)], spans)


def test_a_rounds_timeline_is_each_stages_median_and_slowest() -> None:
    results = [
        rollout(0.010, 0.012, 0.512, 0.400),  # HTTP leg 100 ms
        rollout(0.050, 0.052, 0.652, 0.500),  # 100 ms
        rollout(0.200, 0.201, 0.901, 0.600),  # 100 ms
    ]
    timeline = rollout_gateway.pool_timeline(results, started_wall=100.0, seconds=0.95)
    assert timeline["round"] == pytest.approx(950)
    assert timeline["to_processor_p50"] == pytest.approx(50, abs=1e-3)
    assert timeline["to_processor_max"] == pytest.approx(200, abs=1e-3)
    assert timeline["http_p50"] == pytest.approx(100, abs=1e-3)
    assert timeline["http_max"] == pytest.approx(100, abs=1e-3)
    assert timeline["gateway_p50"] == pytest.approx(500)
    assert timeline["gateway_max"] == pytest.approx(600)


def test_repeat_reads_the_chain_and_timeline_figures() -> None:
    result = {
        "throughput_ratio": 0.74,
        "builtin_throughput_ratio": 0.86,
        "pool_chain_cpu_cores": 0.73,
        "pool_timeline_ms": {"to_processor_max": 186.0, "http_p50": 111.0},
    }
    figures = {name: read(result) for name, read in repeat.FIGURES["rollout_gateway"].items()}
    assert figures == {
        "throughput_ratio": 0.74,
        "builtin_throughput_ratio": 0.86,
        "pool_chain_cpu_cores": 0.73,
        "pool_to_processor_max_ms": 186.0,
        "pool_http_p50_ms": 111.0,
    }
