"""Overlapped rollouts: the example job at several `max_staleness` settings, side by side in one run.

With `max_staleness` k >= 1 the next k steps' rollouts (and their teacher scores) run while the
learner trains: k = 1 exactly one weight version behind, k >= 2 sampling on through the weight updates
(each call at most k behind). An arm is `K` (`max_staleness` K) or `K:sampler` (the same with
`stale_divergence: sampler`, i.e. without the staleness-aware correction of `sampled`'s signal). For
every seed this runs each arm and reports its median step time and samples/s (step 1 excluded: it pays
one-off warm-up, and cannot overlap) and their ratio to arm `0`, how much of a step the learner still
waits for rollouts, the reverse KL at the end and validation exact match: at the end, and after the
same training time (the shortest run's training seconds, start-up and evaluations excluded: the last
validation each run had reached by then). On a CPU box every role shares the same cores, so overlap can
only win what the roles leave idle; on GPUs the roles run on different devices.

Every run is a fresh process (`--one-run ARM`, started by this script), the arms alternating (0, 1, 0,
1, ... one round per seed; interleave.py), so none inherits another's Ray or engines. The record
(records.py; `--record NAME`, `staleness` by default) names its headline `samples_per_s_ratio_median`
(arm 1 over arm 0, per seed); 3 seeds or more make it publishable.

Launch: `.venv/bin/python benchmarks/staleness.py --steps 12 --eval-every 4 --seeds 0 1 2`
(after `opd make-tiny-models`); `--eval-every 0` skips validation (what `gpu_check.sh` runs);
`--arms 0 1 2 2:sampler --distill-loss sampled --record staleness_depth` the deeper pipeline and the
correction; `--publish` also writes the committed record.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from harness import EXAMPLE_JOB, job_spec, run_job, save_figure, write_json
from interleave import run_child, write_one_run
from records import add_publish_arguments, new_record, write_record

SCRIPT = Path(__file__).resolve()


def parse_arm(arm: str) -> tuple[int, str]:
    """`K` or `K:sampler` -> (max_staleness, stale_divergence)."""
    depth, _, divergence = arm.partition(":")
    return int(depth), divergence or "current"


def measure(
    job_file: Path, steps: int, arm: str, seed: int, eval_every: int, distill_loss: str | None
) -> dict[str, Any]:
    eval_steps = eval_every if eval_every > 0 else 10**6
    max_staleness, stale_divergence = parse_arm(arm)
    hyper: dict[str, Any] = {"max_staleness": max_staleness, "stale_divergence": stale_divergence}
    if distill_loss is not None:
        hyper["distill_loss"] = distill_loss
    spec = job_spec(job_file, max_steps=steps, eval_steps=eval_steps, seed=seed, **hyper)
    if eval_every <= 0:
        spec = spec.model_copy(update={"validation_datasets": []})
    run = run_job(spec)
    measured = run.train[1:]
    curve = run.exact_match_curve()
    return {
        "arm": arm,
        "max_staleness": max_staleness,
        "stale_divergence": stale_divergence,
        "distill_loss": spec.hyper_parameters.distill_loss,
        "seed": seed,
        "steps_measured": len(measured),
        "step_s": statistics.median(r["time/step_s"] for r in measured),
        "samples_per_s": statistics.median(r["rollouts"] / r["time/step_s"] for r in measured),
        "rollout_wait_s": statistics.median(r["time/rollout_s"] for r in measured),
        "teacher_wait_s": statistics.median(r["time/teacher_s"] for r in measured),
        "learner_s": statistics.median(r["time/learner_s"] for r in measured),
        "staleness_mean": statistics.mean(r["staleness/mean"] for r in measured),
        "staleness_max": max(r["staleness/max"] for r in measured),
        "final_reverse_kl": run.train[-1]["reverse_kl"],
        "train_s": run.train_s,
        "curve": curve,
        "final_exact_match": curve[-1]["exact_match"] if curve else None,
    }


def exact_match_by(curve: list[dict[str, Any]], train_s: float) -> float | None:
    """The last validation a run had reached after `train_s` training seconds."""
    reached = [p for p in curve if p["train_s"] <= train_s + 1e-9]
    return reached[-1]["exact_match"] if reached else None


def compare(by_arm: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One seed's arms against arm `0` (the first arm if there is none)."""
    base = by_arm.get("0", next(iter(by_arm.values())))
    common_s = min(run["train_s"] for run in by_arm.values())
    return {
        "seed": base["seed"],
        "samples_per_s_ratio": {
            arm: run["samples_per_s"] / base["samples_per_s"]
            for arm, run in by_arm.items()
            if run is not base
        },
        "common_train_s": common_s,
        "exact_match_at_common_s": {
            arm: exact_match_by(run["curve"], common_s) for arm, run in by_arm.items()
        },
    }


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    arms = list(dict.fromkeys(run["arm"] for run in runs))
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    colours = {arm: palette[i % len(palette)] for i, arm in enumerate(arms)}
    for run in runs:
        if not run["curve"]:
            continue
        label = f"max_staleness {run['arm']}, seed {run['seed']}"
        ax.plot(
            [p["train_s"] for p in run["curve"]],
            [p["exact_match"] for p in run["curve"]],
            marker="o",
            color=colours[run["arm"]],
            alpha=0.4 + 0.2 * (run["seed"] % 3),
            label=label,
        )
    ax.set(xlabel="training seconds (start-up and evaluations excluded)", ylabel="validation exact match")
    ax.set_title(f"max_staleness {' vs '.join(arms)}: accuracy by training time")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=EXAMPLE_JOB)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="each runs every arm")
    parser.add_argument(
        "--arms",
        nargs="+",
        default=["0", "1"],
        help="max_staleness settings, K or K:sampler (stale_divergence sampler), in run order per seed",
    )
    parser.add_argument("--distill-loss", default=None, help="the estimator (default: the job's)")
    parser.add_argument("--record", default="staleness", help="the record's name")
    parser.add_argument(
        "--eval-every", type=int, default=0, help="validate every N steps (0: no validation, timing only)"
    )
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/RECORD.json")
    add_publish_arguments(parser)
    parser.add_argument("--one-run", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--one-run-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run is not None:
        result = measure(args.job, args.steps, args.one_run, args.seed, args.eval_every, args.distill_loss)
        write_one_run(args.one_run_out, result)
        return
    for arm in args.arms:
        parse_arm(arm)  # a bad arm fails here, before any run
    out = args.out or Path(f"benchmarks/results/{args.record}.json")
    runs: list[dict[str, Any]] = []
    comparisons = []
    shared = ["--job", str(args.job), "--steps", str(args.steps), "--eval-every", str(args.eval_every)]
    if args.distill_loss is not None:
        shared += ["--distill-loss", args.distill_loss]
    for seed in args.seeds:
        by_arm = {arm: run_child(SCRIPT, arm, [*shared, "--seed", str(seed)]) for arm in args.arms}
        runs += by_arm.values()
        comparisons.append(compare(by_arm))
        print(json.dumps(comparisons[-1]), flush=True)
    ratios = [c["samples_per_s_ratio"].get("1") for c in comparisons]
    result = {"runs": runs, "per_seed": comparisons}
    if all(r is not None for r in ratios):
        result["samples_per_s_ratio"] = statistics.median(ratios)  # type: ignore[type-var]
    print(
        f"{'max_staleness':<14}{'seed':>5}{'step s':>9}{'samples/s':>11}{'rollout wait s':>16}"
        f"{'learner s':>11}{'train s':>9}{'final KL':>10}{'final EM':>10}"
    )
    for row in runs:
        final = "-" if row["final_exact_match"] is None else f"{row['final_exact_match']:.3f}"
        print(
            f"{row['arm']:<14}{row['seed']:>5}{row['step_s']:>9.2f}{row['samples_per_s']:>11.2f}"
            f"{row['rollout_wait_s']:>16.2f}{row['learner_s']:>11.2f}{row['train_s']:>9.1f}"
            f"{row['final_reverse_kl']:>10.4f}{final:>10}"
        )
    for c in comparisons:
        ratio_text = ", ".join(f"{arm} / 0 = {r:.2f}x" for arm, r in c["samples_per_s_ratio"].items())
        at = ", ".join(f"{v} ({arm})" for arm, v in c["exact_match_at_common_s"].items())
        common = f"{c['common_train_s']:.1f}"
        print(f"seed {c['seed']}: samples/s {ratio_text}; exact match after {common} training s: {at}")
    write_json(out, result)
    figures: dict[str, list[float | None]] = {}
    if "samples_per_s_ratio" in result:
        figures["samples_per_s_ratio"] = ratios
    for arm in args.arms:
        own = [r for r in runs if r["arm"] == arm]
        figures[f"samples_per_s/{arm}"] = [r["samples_per_s"] for r in own]
        figures[f"final_exact_match/{arm}"] = [r["final_exact_match"] for r in own]
        figures[f"final_reverse_kl/{arm}"] = [r["final_reverse_kl"] for r in own]
    record = new_record(
        args.record,
        {k: v for k, v in vars(args).items() if k not in {"one_run", "one_run_out", "seed"}},
        seeds=args.seeds,
        runs=runs,
        figures=figures,
        headline=["samples_per_s_ratio"] if "samples_per_s_ratio" in figures else [],
        models_dir=None,
        notes=[f"one round per seed, arms {' then '.join(args.arms)}, each a fresh process"],
    )
    write_record(record, publish=args.publish, results_dir=args.results_dir, published_dir=args.published_dir)
    if args.eval_every > 0:
        plot(runs, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
