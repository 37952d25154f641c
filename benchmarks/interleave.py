"""Repeated, interleaved side-by-side runs: A, B, A, B, ... each in a fresh process.

A benchmark that compares two sides (ours vs TRL, max_staleness 1 vs 0, before vs after) runs each side
as a subprocess of its own script with `--one-run SIDE --one-run-out PATH` (plus the side's arguments);
the child measures one run and writes its raw values as JSON to PATH. `interleave` runs the pairs in
the order A, B, A, B, ... so that a machine that drifts over minutes drifts under both sides alike,
and every run starts cold in a fresh process (no Ray, engines, caches or threads left by the other
side). The warm-up is the same for both sides: each run's first training step is its warm-up, left out
of throughput figures on both sides (and counted in time-to-accuracy on both sides).

`summarize_pairs` then gives each side's median and range and the per-pair ratios' median and range.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from records import summarize

DEFAULT_PAIRS = 3


def add_one_run_arguments(parser: argparse.ArgumentParser, sides: Sequence[str]) -> None:
    """`--one-run SIDE --one-run-out PATH`: the child's flags (not for people; `interleave` sets them)."""
    parser.add_argument("--one-run", choices=list(sides), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--one-run-out", type=Path, default=None, help=argparse.SUPPRESS)


def write_one_run(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result) + "\n")


def run_child(script: Path, side: str, args: Sequence[str], timeout_s: float | None = None) -> dict[str, Any]:
    """One run of `side` in a fresh `python script ... --one-run side` process; its JSON result, with
    `wall_s` of the whole process (start-up included) added as `process_wall_s`."""
    with tempfile.TemporaryDirectory(prefix="opd-bench-run-") as scratch:
        out = Path(scratch) / "run.json"
        cmd = [sys.executable, str(script), *args, "--one-run", side, "--one-run-out", str(out)]
        print(f"[interleave] {side}: {' '.join(cmd[1:])}", flush=True)
        # A Ray temp dir of its own: a local Ray started by the child cannot find and join another Ray on
        # this machine (ray.init() without an address joins the cluster named in
        # <tmp>/ray/ray_current_cluster, e.g. a test's `ray.cluster_utils.Cluster`), and nothing of it
        # outlives the run.
        env = {**os.environ}
        if not env.get("RAY_ADDRESS"):
            env["RAY_TMPDIR"] = scratch
        started = time.perf_counter()
        subprocess.run(cmd, check=True, timeout=timeout_s, env=env)
        result: dict[str, Any] = json.loads(out.read_text())
    result["process_wall_s"] = time.perf_counter() - started
    return result


def interleave(
    run_a: Callable[[int], dict[str, Any]],
    run_b: Callable[[int], dict[str, Any]],
    pairs: int = DEFAULT_PAIRS,
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """`pairs` pairs run A, B, A, B, ...; `run_a(i)` / `run_b(i)` run pair i's side (e.g. `run_child`)."""
    out = []
    for i in range(pairs):
        a = run_a(i)
        b = run_b(i)
        out.append((a, b))
    return out


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def summarize_pairs(
    pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]],
    value: Callable[[dict[str, Any]], float | None],
    a_over_b: bool = True,
) -> dict[str, Any]:
    """Each side's summary of `value`, and the per-pair ratio's (A / B, or B / A with `a_over_b=False`)."""
    a_values = [value(a) for a, _ in pairs]
    b_values = [value(b) for _, b in pairs]
    ratios = [ratio(a, b) if a_over_b else ratio(b, a) for a, b in zip(a_values, b_values, strict=True)]
    return {"a": summarize(a_values), "b": summarize(b_values), "ratio": summarize(ratios)}
