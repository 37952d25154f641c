"""Repeat a one-sided benchmark in fresh processes and write its record (records.py) from every run.

For the benchmarks that measure one thing per run (engine_throughput, rollout_gateway, step_breakdown,
learner_step, api_load, efficacy, estimate_error): runs `benchmarks/<name>.py <args> --out <scratch>`
`--runs` times, each a fresh process, one after another, reads the figures below from each run's JSON
and writes one record whose figures are the per-run values (median, range, runs). A figure a run gives
per seed (efficacy) counts each seed as a run.

    .venv/bin/python benchmarks/repeat.py step_breakdown --runs 3 --publish -- --steps 6

`--refigure PUBLISHED_RECORD` runs nothing: it recomputes an earlier record's figures from that record's
own runs (a figure added since), keeping its runs, machine, versions and command, and notes it.

The side-by-side benchmarks (vs_trl_gkd, staleness) interleave their own sides instead
(interleave.py) and are not run through this.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from records import add_publish_arguments, load_record, new_record, summarize, write_record

HERE = Path(__file__).resolve().parent
Extract = Callable[[dict[str, Any]], "float | list[float | None] | None"]


def _api_read_p99(r: dict[str, Any]) -> float:
    return float(max(x["p99_ms"] for x in r["rows"] if x["operation"].startswith("poll")))


def _opd_arm(r: dict[str, Any]) -> str:
    return str(r.get("headline_opd_arm") or "opd")


def _gap_closed(r: dict[str, Any]) -> list[float | None]:
    return [(s["end"] - s["start"]) / (s["teacher"] - s["start"]) for s in r["runs"][_opd_arm(r)]]


def _first(seed: dict[str, Any], level: float, key: str) -> float | None:
    threshold = seed["start"] + level * (seed["teacher"] - seed["start"])
    return next((p[key] for p in seed["curve"] if p["exact_match"] >= threshold), None)


def _steps_ratio(level: float) -> Extract:
    """RL's steps to `level` of the gap over OPD's, per seed, RL at its best learning rate
    (`best_rl_arm`, where the run swept it); RL not reaching it counts as its budget (`rl_steps`)."""

    def extract(r: dict[str, Any]) -> list[float | None]:
        rl_arm = r.get("best_rl_arm") or "rl"
        if rl_arm not in r["runs"]:
            return []
        out: list[float | None] = []
        for opd, rl in zip(r["runs"][_opd_arm(r)], r["runs"][rl_arm], strict=True):
            opd_steps = _first(opd, level, "step")
            rl_steps = _first(rl, level, "step")
            budget = r["settings"].get("rl_steps", r["settings"]["steps"])
            rl_steps = rl_steps if rl_steps is not None else budget
            out.append(rl_steps / opd_steps if opd_steps else None)
        return out

    return extract


def _abs_error(key: str) -> Extract:
    """|estimate - actual| / actual of one metered key (estimate_error)."""
    return lambda r: abs(r["relative_error"][key])


# benchmark -> figure -> how to read it from one run's JSON (`--out`).
FIGURES: dict[str, dict[str, Extract]] = {
    "engine_throughput": {
        "generate_ratio": lambda r: r["generate_ratio"],
        "generate_ratio_same_work": lambda r: r["generate_ratio_same_work"],
        "score_ratio": lambda r: r["score_ratio"],
        "top_k_score_over_sampled": lambda r: r["top_k_score_over_sampled"],
        "weight_update_over_copy": lambda r: r["weight_update_over_copy"],
    },
    "rollout_gateway": {
        "throughput_ratio": lambda r: r["throughput_ratio"],
        "builtin_throughput_ratio": lambda r: r["builtin_throughput_ratio"],
        # The pool path's CPU outside the engine, in cores kept busy over a round: on a 2-core box the
        # engine's thread holds one core and the chain (driver, worker, sandbox, gateway) queues on the rest.
        "pool_chain_cpu_cores": lambda r: r["pool_chain_cpu_cores"],
        "pool_to_processor_max_ms": lambda r: r["pool_timeline_ms"]["to_processor_max"],
        "pool_http_p50_ms": lambda r: r["pool_timeline_ms"]["http_p50"],
    },
    "job_startup": {
        "submit_to_first_step_s": lambda r: r["submit_to_first_step_s"],
        "submit_to_training_s": lambda r: r["submit_to_training_s"],
        "first_step_s": lambda r: r["first_step_s"],
    },
    "step_breakdown": {
        "other_percent": lambda r: r["parts_percent"]["other"],
        "teacher_percent": lambda r: r["parts_percent"]["teacher"],
        "rollout_percent": lambda r: r["parts_percent"]["rollout"],
        # The signal phase with the recorded trajectories' per-token view (the console's), timed inside
        # the step: the step's cost of recording them.
        "record_percent": lambda r: r["parts_percent"]["record"],
        "step_s": lambda r: r["step_s"],
        "learner_s": lambda r: r["parts_s"]["learner"],
        "samples_per_s": lambda r: r["samples_per_s"],
        "tokens_per_s": lambda r: r["tokens_per_s"],
        "learner_fraction_of_matmul_limit": lambda r: r["learner_fraction_of_matmul_limit"],
    },
    "learner_step": {
        "train_step_s": lambda r: r["train_step_s"],
    },
    "api_load": {
        "read_p99_ms": _api_read_p99,
        "server_errors_5xx": lambda r: float(sum(x["server_errors_5xx"] for x in r["rows"])),
    },
    "efficacy": {
        "gap_closed": _gap_closed,
        "train_s_to_90": lambda r: [_first(s, 0.9, "train_s") for s in r["runs"][_opd_arm(r)]],
        "steps_to_50_ratio": _steps_ratio(0.5),
        "steps_to_90_ratio": _steps_ratio(0.9),
    },
    "estimate_error": {
        f"{key}_abs_error": _abs_error(key)
        for key in ("teacher_tokens", "student_generated_tokens", "learner_tokens_trained", "cpu_s", "wall_s")
    },
}
HEADLINE = {
    "engine_throughput": ["generate_ratio", "score_ratio"],
    "rollout_gateway": ["throughput_ratio"],
    "job_startup": ["submit_to_first_step_s"],
    "step_breakdown": ["other_percent", "teacher_percent", "record_percent"],
    "learner_step": ["train_step_s"],
    "api_load": ["read_p99_ms"],
    "efficacy": ["gap_closed"],
    "estimate_error": ["teacher_tokens_abs_error", "wall_s_abs_error"],
}


def figures_of(benchmark: str, results: list[dict[str, Any]]) -> dict[str, list[float | None]]:
    out: dict[str, list[float | None]] = {}
    for name, extract in FIGURES[benchmark].items():
        values: list[float | None] = []
        for result in results:
            try:
                value = extract(result)
            except (KeyError, TypeError, ZeroDivisionError):
                value = None
            values += value if isinstance(value, list) else [value]
        out[name] = values
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("benchmark", choices=sorted(FIGURES))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models-dir", type=Path, default=None, help="for the record's model manifest")
    add_publish_arguments(parser)
    parser.epilog = "Arguments after `--` go to the benchmark's script."
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    parser.add_argument(
        "--refigure",
        type=Path,
        default=None,
        help="recompute this record's figures from its own runs (no new run) and write it again",
    )
    args = parser.parse_args(argv[:cut])
    if args.refigure is not None:
        refigure(args, argv)
        return
    script_args = argv[cut + 1 :]
    results, runs = [], []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="opd-bench-repeat-") as scratch:
            out = Path(scratch) / "result.json"
            cmd = [sys.executable, str(HERE / f"{args.benchmark}.py"), *script_args, "--out", str(out)]
            print(f"[repeat] run {i + 1}/{args.runs}: {' '.join(cmd[1:])}", flush=True)
            subprocess.run(cmd, check=True)
            result = json.loads(out.read_text())
        results.append(result)
        runs.append({"run": i, "result": result})
    seeds = sorted({s for r in results for s in r.get("settings", {}).get("seeds", [])})
    record = new_record(
        args.benchmark,
        args,
        seeds=seeds,
        runs=runs,
        figures=figures_of(args.benchmark, results),
        headline=HEADLINE[args.benchmark],
        models_dir=args.models_dir,
        notes=[
            f"{args.runs} runs of benchmarks/{args.benchmark}.py, each a fresh process, one after another"
        ],
    )
    write_record(record, publish=args.publish, results_dir=args.results_dir, published_dir=args.published_dir)
    for name, s in record.figures.items():
        print(f"{name:<36} median {s['median']}  range {s['min']}–{s['max']}  runs {s['runs']}")


def refigure(args: argparse.Namespace, argv: list[str]) -> None:
    """An earlier record with its figures recomputed from its runs by today's `FIGURES`."""
    record = load_record(args.refigure)
    if record.benchmark != args.benchmark:
        raise SystemExit(f"--refigure: {args.refigure} is a {record.benchmark} record, not {args.benchmark}")
    results = [run["result"] for run in record.runs]
    record.figures = {name: summarize(values) for name, values in figures_of(args.benchmark, results).items()}
    record.headline = {f"{name}_median": record.figures[name]["median"] for name in HEADLINE[args.benchmark]}
    command = " ".join(["benchmarks/repeat.py", *argv])
    record.notes.append(f"figures recomputed from these runs by: {command}")
    write_record(record, publish=args.publish, results_dir=args.results_dir, published_dir=args.published_dir)


if __name__ == "__main__":
    main()
