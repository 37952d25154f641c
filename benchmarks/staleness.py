"""Overlapped rollouts: the example job with `max_staleness: 0` and `1`, side by side in one run.

With `max_staleness: 1` the next step's rollouts (and their teacher scores) run while the learner
trains, one weight version behind. For every seed this runs both settings and reports each one's
median step time and samples/s (step 1 excluded: it pays one-off warm-up, and cannot overlap) and
their ratio, how much of a step the learner still waits for rollouts, and validation exact match:
at the end, and after the same training time (the shorter run's training seconds, start-up and
evaluations excluded: the last validation each run had reached by then). On a CPU box every role
shares the same cores, so overlap can only win what the roles leave idle; on GPUs the roles run on
different devices.

Every run is a fresh process (`--one-run 0|1`, started by this script), the two settings alternating
(0, 1, 0, 1, ... one pair per seed; interleave.py), so neither inherits the other's Ray or engines. The
record (records.py) names its headline `samples_per_s_ratio_median` (1 over 0, per pair); 3 seeds or
more make it publishable.

Launch: `.venv/bin/python benchmarks/staleness.py --steps 12 --eval-every 4 --seeds 0 1 2`
(after `opd make-tiny-models`); `--eval-every 0` skips validation (what `gpu_check.sh` runs);
`--publish` also writes the committed record.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from harness import EXAMPLE_JOB, job_spec, run_job, save_figure, write_json
from interleave import add_one_run_arguments, run_child, write_one_run
from records import add_publish_arguments, new_record, write_record

SCRIPT = Path(__file__).resolve()


def measure(job_file: Path, steps: int, max_staleness: int, seed: int, eval_every: int) -> dict[str, Any]:
    eval_steps = eval_every if eval_every > 0 else 10**6
    spec = job_spec(job_file, max_steps=steps, eval_steps=eval_steps, max_staleness=max_staleness, seed=seed)
    if eval_every <= 0:
        spec = spec.model_copy(update={"validation_datasets": []})
    run = run_job(spec)
    measured = run.train[1:]
    curve = run.exact_match_curve()
    return {
        "max_staleness": max_staleness,
        "seed": seed,
        "steps_measured": len(measured),
        "step_s": statistics.median(r["time/step_s"] for r in measured),
        "samples_per_s": statistics.median(r["rollouts"] / r["time/step_s"] for r in measured),
        "rollout_wait_s": statistics.median(r["time/rollout_s"] for r in measured),
        "teacher_wait_s": statistics.median(r["time/teacher_s"] for r in measured),
        "learner_s": statistics.median(r["time/learner_s"] for r in measured),
        "staleness_mean": statistics.mean(r["staleness/mean"] for r in measured),
        "final_reverse_kl": run.train[-1]["reverse_kl"],
        "train_s": run.train_s,
        "curve": curve,
        "final_exact_match": curve[-1]["exact_match"] if curve else None,
    }


def exact_match_by(curve: list[dict[str, Any]], train_s: float) -> float | None:
    """The last validation a run had reached after `train_s` training seconds."""
    reached = [p for p in curve if p["train_s"] <= train_s + 1e-9]
    return reached[-1]["exact_match"] if reached else None


def compare(on_policy: dict[str, Any], overlapped: dict[str, Any]) -> dict[str, Any]:
    common_s = min(on_policy["train_s"], overlapped["train_s"])
    return {
        "seed": on_policy["seed"],
        "samples_per_s_ratio": overlapped["samples_per_s"] / on_policy["samples_per_s"],
        "common_train_s": common_s,
        "exact_match_at_common_s": {
            "0": exact_match_by(on_policy["curve"], common_s),
            "1": exact_match_by(overlapped["curve"], common_s),
        },
    }


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    colours = {0: "tab:blue", 1: "tab:orange"}
    for run in runs:
        if not run["curve"]:
            continue
        label = f"max_staleness {run['max_staleness']}, seed {run['seed']}"
        ax.plot(
            [p["train_s"] for p in run["curve"]],
            [p["exact_match"] for p in run["curve"]],
            marker="o",
            color=colours[run["max_staleness"]],
            alpha=0.4 + 0.2 * (run["seed"] % 3),
            label=label,
        )
    ax.set(xlabel="training seconds (start-up and evaluations excluded)", ylabel="validation exact match")
    ax.set_title("max_staleness 0 vs 1: accuracy by training time")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=EXAMPLE_JOB)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="each runs both settings")
    parser.add_argument(
        "--eval-every", type=int, default=0, help="validate every N steps (0: no validation, timing only)"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/staleness.json"))
    add_publish_arguments(parser)
    add_one_run_arguments(parser, ["0", "1"])
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run is not None:
        write_one_run(
            args.one_run_out, measure(args.job, args.steps, int(args.one_run), args.seed, args.eval_every)
        )
        return
    runs: list[dict[str, Any]] = []
    comparisons = []
    shared = ["--job", str(args.job), "--steps", str(args.steps), "--eval-every", str(args.eval_every)]
    for seed in args.seeds:
        on_policy = run_child(SCRIPT, "0", [*shared, "--seed", str(seed)])
        overlapped = run_child(SCRIPT, "1", [*shared, "--seed", str(seed)])
        runs += [on_policy, overlapped]
        comparisons.append(compare(on_policy, overlapped))
        print(json.dumps(comparisons[-1]), flush=True)
    ratios = [c["samples_per_s_ratio"] for c in comparisons]
    result = {
        "runs": runs,
        "per_seed": comparisons,
        "samples_per_s_ratio": statistics.median(ratios),
        # The single-seed shape earlier reports and the GPU check read.
        "on_policy": runs[0],
        "overlapped": runs[1],
    }
    print(
        f"{'max_staleness':<14}{'seed':>5}{'step s':>9}{'samples/s':>11}{'rollout wait s':>16}"
        f"{'learner s':>11}{'train s':>9}{'final EM':>10}"
    )
    for row in runs:
        final = "-" if row["final_exact_match"] is None else f"{row['final_exact_match']:.3f}"
        print(
            f"{row['max_staleness']:<14}{row['seed']:>5}{row['step_s']:>9.2f}{row['samples_per_s']:>11.2f}"
            f"{row['rollout_wait_s']:>16.2f}{row['learner_s']:>11.2f}{row['train_s']:>9.1f}{final:>10}"
        )
    for c in comparisons:
        at = c["exact_match_at_common_s"]
        print(
            f"seed {c['seed']}: samples/s 1 / 0 = {c['samples_per_s_ratio']:.2f}x; exact match after "
            f"{c['common_train_s']:.1f} training s: {at['0']} (0) vs {at['1']} (1)"
        )
    print(f"samples/s, max_staleness 1 / 0 (median over seeds): {result['samples_per_s_ratio']:.2f}x")
    write_json(args.out, result)
    record = new_record(
        "staleness",
        {k: v for k, v in vars(args).items() if k not in {"one_run", "one_run_out", "seed"}},
        seeds=args.seeds,
        runs=runs,
        figures={
            "samples_per_s_ratio": ratios,
            "samples_per_s/0": [r["samples_per_s"] for r in runs if r["max_staleness"] == 0],
            "samples_per_s/1": [r["samples_per_s"] for r in runs if r["max_staleness"] == 1],
            "final_exact_match/0": [r["final_exact_match"] for r in runs if r["max_staleness"] == 0],
            "final_exact_match/1": [r["final_exact_match"] for r in runs if r["max_staleness"] == 1],
        },
        headline=["samples_per_s_ratio"],
        models_dir=None,
        notes=["one pair per seed, max_staleness 0 then 1, each a fresh process"],
    )
    write_record(record, publish=args.publish, results_dir=args.results_dir, published_dir=args.published_dir)
    if args.eval_every > 0:
        plot(runs, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
