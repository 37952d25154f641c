"""Does it learn: OPD vs reward-only RL vs OPD + reward on the tiny tool-routing task, over seeds.

Same tiny teacher and student, same data, steps and seeds for every arm:
- `opd`: kl_coef 1, reward_coef 0 (dense per-token teacher signal, no reward functions);
- `rl`: kl_coef 0, reward_coef 1 with the example's rewards (decision + arguments, group baseline);
- `opd+rl`: kl_coef 1, reward_coef 1 with the same rewards;
- `opd:<estimator>` (one per `--distill-losses`): the `opd` arm with `hyper_parameters.distill_loss`
  set to that estimator (and `teacher_top_k` to `--teacher-top-k` if it reads the teacher's top-k);
- `rl@<lr>` (one per `--rl-learning-rates`): the `rl` arm at that learning rate, so the baseline is
  compared at its best setting (the RL arm with the highest mean final exact match, `best_rl_arm`),
  not at OPD's learning rate.

The reward-only arms (`rl`, `rl@<lr>`) train for `--rl-steps` (default: `--steps`): a longer budget, so
"RL needs N× more steps" is measured where RL gets there rather than bounded by OPD's budget.

Per arm: validation exact match and reverse KL against step, and exact match against training seconds
(mean and spread over seeds, plotted), and a
table of start, end, teacher, fraction of the teacher–student gap closed, steps and training seconds to
close 90 % of the gap (the first validation at or above start + 0.9·(teacher − start)). Training seconds
sum the steps' wall time; evaluations and start-up are excluded and reported apart.

Launch (after `opd make-tiny-models .cache/tiny-models`):
`.venv/bin/python benchmarks/efficacy.py --seeds 0 1 2 --steps 40 --eval-steps 5`
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import JobRun, example_rewards, job_spec, run_job, save_figure, write_json

from opd_trainer.jobspec.estimators import DEFAULT_TEACHER_TOP_K
from opd_trainer.jobspec.job_spec import DEFAULT_DISTILL_LOSS
from opd_trainer.learner.estimators import ESTIMATORS

ARMS: dict[str, dict[str, Any]] = {
    "opd": {"kl_coef": 1.0, "reward_coef": 0.0, "rewards": False},
    "rl": {"kl_coef": 0.0, "reward_coef": 1.0, "rewards": True},
    "opd+rl": {"kl_coef": 1.0, "reward_coef": 1.0, "rewards": True},
}
# Fractions of the teacher–student gap whose first crossing is reported (90 %: the target).
GAP_LEVELS = (0.5, 0.9)


ESTIMATOR_ARM = "opd:"
RL_LR_ARM = "rl@"


def rl_lr_arm(learning_rate: float) -> str:
    return f"{RL_LR_ARM}{learning_rate:g}"


def best_rl_arm(arms: dict[str, dict[str, Any]]) -> str | None:
    """The reward-only arm (`rl`, `rl@<lr>`) with the highest mean final exact match: the baseline at
    its best learning rate."""
    candidates = [name for name in arms if is_rl_arm(name)]
    return max(candidates, key=lambda name: arms[name]["end"], default=None)


def estimator_arm(distill_loss: str) -> str:
    return f"{ESTIMATOR_ARM}{distill_loss}"


def headline_opd_arm(arms: dict[str, Any]) -> str | None:
    """The arm the headline numbers quote: `opd` (the job's own estimator) or the default estimator's."""
    for name in ("opd", estimator_arm(DEFAULT_DISTILL_LOSS)):
        if name in arms:
            return name
    return None


def is_rl_arm(arm: str) -> bool:
    """Whether `arm` is reward-only RL (`rl` or one of its learning rates)."""
    return arm == "rl" or arm.startswith(RL_LR_ARM)


def arm_steps(arm: str, steps: int, rl_steps: int | None) -> int:
    """The steps `arm` trains for: `rl_steps` for the reward-only arms where given, else `steps`."""
    return rl_steps if rl_steps is not None and is_rl_arm(arm) else steps


def arm_spec(arm: str, seed: int, steps: int, eval_steps: int, teacher_top_k: int = 8) -> Any:
    estimator: dict[str, Any] = {}
    if arm.startswith(RL_LR_ARM):
        estimator = {"learning_rate": float(arm.removeprefix(RL_LR_ARM))}
        arm = "rl"
    elif arm.startswith(ESTIMATOR_ARM):
        distill_loss = arm.removeprefix(ESTIMATOR_ARM)
        top_k = teacher_top_k if ESTIMATORS[distill_loss].needs_top_k else 0
        estimator = {"distill_loss": distill_loss, "teacher_top_k": top_k}
        arm = "opd"
    settings = ARMS[arm]
    return job_spec(
        functions=example_rewards() if settings["rewards"] else [],
        max_steps=steps,
        eval_steps=eval_steps,
        seed=seed,
        kl_coef=settings["kl_coef"],
        reward_coef=settings["reward_coef"],
        **estimator,
    )


def curve(run: JobRun) -> list[dict[str, float]]:
    """Validation points (step 0 = before training) with cumulative training seconds."""
    return [
        {
            "step": r["step"],
            "exact_match": r["exact_match"],
            "reverse_kl": r["reverse_kl"],
            "train_s": run.train_s_until(r["step"]),
        }
        for r in run.evals
    ]


def first_reaching(points: list[dict[str, float]], threshold: float) -> dict[str, float] | None:
    return next((p for p in points if p["exact_match"] >= threshold), None)


def summarize_seed(run: JobRun) -> dict[str, Any]:
    return {
        "start": run.summary["student_before"]["exact_match"],
        "end": run.summary["student_after"]["exact_match"],
        "teacher": run.summary["teacher"]["exact_match"],
        "train_s": run.train_s,
        "wall_s": run.wall_s,
        "curve": curve(run),
        "reward_mean": [r.get("reward_mean") for r in run.train],
    }


def gap_level(seed: dict[str, Any], level: float) -> dict[str, float] | None:
    """The first validation at or above start + level·(teacher − start), or None."""
    gap = seed["teacher"] - seed["start"]
    return first_reaching(seed["curve"], seed["start"] + level * gap) if gap > 0 else None


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def summarize_arm(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    arm: dict[str, Any] = {
        "start": _mean([s["start"] for s in seeds]),
        "end": _mean([s["end"] for s in seeds]),
        "end_std": statistics.pstdev([s["end"] for s in seeds]),
        "teacher": _mean([s["teacher"] for s in seeds]),
        "gap_closed": _mean([(s["end"] - s["start"]) / (s["teacher"] - s["start"]) for s in seeds]),
        "wall_s": _mean([s["wall_s"] for s in seeds]),
    }
    for level in GAP_LEVELS:
        tag = f"{level:.0%}".rstrip("%")
        reached = [point for point in (gap_level(s, level) for s in seeds) if point is not None]
        arm[f"seeds_reaching_{tag}"] = f"{len(reached)}/{len(seeds)}"
        # Over the seeds that reached it; None when none did within the steps run.
        arm[f"steps_to_{tag}"] = _mean([p["step"] for p in reached]) if reached else None
        arm[f"train_s_to_{tag}"] = _mean([p["train_s"] for p in reached]) if reached else None
    return arm


def format_table(arms: dict[str, dict[str, Any]], steps: int, rl_steps: int | None = None) -> str:
    levels = "".join(f"{'steps→' + format(level, '.0%'):>12}{'reached':>8}" for level in GAP_LEVELS)
    header = f"{'arm':<22}{'start':>7}{'end':>13}{'teacher':>9}{'gap closed':>12}{levels}{'train s→90%':>13}"
    lines = [header, "-" * len(header)]
    for name, arm in arms.items():
        cells = ""
        for level in GAP_LEVELS:
            tag = f"{level:.0%}".rstrip("%")
            value = arm[f"steps_to_{tag}"]
            shown = f"{value:.1f}" if value is not None else f">{arm_steps(name, steps, rl_steps)}"
            cells += f"{shown:>12}{arm[f'seeds_reaching_{tag}']:>8}"
        secs_90 = f"{arm['train_s_to_90']:.0f}" if arm["train_s_to_90"] is not None else "—"
        lines.append(
            f"{name:<22}{arm['start']:>7.3f}{arm['end']:>8.3f}±{arm['end_std']:<4.3f}{arm['teacher']:>9.3f}"
            f"{arm['gap_closed']:>11.0%} {cells}{secs_90:>13}"
        )
    return "\n".join(lines)


def step_ratio(arms: dict[str, dict[str, Any]], steps: int, level: float) -> str:
    """How many times fewer steps OPD needs than reward-only RL (its best learning rate's arm) to close
    `level` of the gap; `steps` is RL's budget."""
    tag = f"{level:.0%}".rstrip("%")
    headline, baseline = headline_opd_arm(arms), best_rl_arm(arms)
    opd = arms.get(headline) if headline else None
    rl = arms.get(baseline) if baseline else None
    if not opd or not rl or opd[f"steps_to_{tag}"] is None:
        return f"{level:.0%} of the gap: OPD did not reach it, no step ratio"
    if rl[f"steps_to_{tag}"] is None:
        ratio = steps / opd[f"steps_to_{tag}"]
        return f"{level:.0%} of the gap: RL did not reach it in {steps} steps, OPD needs > {ratio:.1f}x fewer"
    ratio = rl[f"steps_to_{tag}"] / opd[f"steps_to_{tag}"]
    seeds = f"seeds reaching it: OPD {opd[f'seeds_reaching_{tag}']}, RL {rl[f'seeds_reaching_{tag}']}"
    return f"{level:.0%} of the gap: OPD needs {ratio:.1f}x fewer steps than RL ({baseline}; {seeds})"


def plot(per_arm: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for name, seeds in per_arm.items():
        steps = [p["step"] for p in seeds[0]["curve"]]
        for ax, key in zip(axes, ("exact_match", "reverse_kl"), strict=False):
            values = [[p[key] for p in s["curve"]] for s in seeds]
            mean = [statistics.fmean(column) for column in zip(*values, strict=True)]
            low = [min(column) for column in zip(*values, strict=True)]
            high = [max(column) for column in zip(*values, strict=True)]
            (line,) = ax.plot(steps, mean, marker="o", label=f"{name} (mean of {len(seeds)} seeds)")
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2)
        # Wall time: each seed's own training seconds at its validations (steps' time, no evaluation).
        seconds = [
            statistics.fmean(column)
            for column in zip(*([p["train_s"] for p in s["curve"]] for s in seeds), strict=True)
        ]
        accuracy = [
            statistics.fmean(column)
            for column in zip(*([p["exact_match"] for p in s["curve"]] for s in seeds), strict=True)
        ]
        axes[2].plot(seconds, accuracy, marker="o", label=name)
    teacher = statistics.fmean(s["teacher"] for seeds in per_arm.values() for s in seeds)
    for ax in (axes[0], axes[2]):
        ax.axhline(teacher, color="black", linestyle="--", label="teacher")
    axes[0].set(xlabel="step", ylabel="validation exact match", title="Accuracy (band: min–max over seeds)")
    axes[1].set(xlabel="step", ylabel="reverse KL per token", title="Reverse KL(student ‖ teacher)")
    axes[2].set(
        xlabel="training seconds (mean over seeds)",
        ylabel="validation exact match",
        title="Accuracy by wall time",
    )
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    parser.add_argument(
        "--distill-losses",
        nargs="*",
        default=[],
        choices=list(ESTIMATORS),
        help="add one `opd:<estimator>` arm per distill_loss (the `opd` arm keeps the job's own)",
    )
    parser.add_argument(
        "--teacher-top-k",
        type=int,
        default=DEFAULT_TEACHER_TOP_K,
        help="teacher_top_k of every estimator arm that reads the teacher's top-k",
    )
    parser.add_argument(
        "--rl-learning-rates",
        nargs="*",
        type=float,
        default=[],
        help="add one `rl@<lr>` arm per learning rate (the RL baseline swept; the best is compared)",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--rl-steps",
        type=int,
        default=None,
        help="steps of the reward-only arms (rl, rl@<lr>): the baseline's longer budget (default: --steps)",
    )
    parser.add_argument("--eval-steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/efficacy.json"))
    parser.add_argument("--plot", type=Path, default=Path("benchmarks/results/efficacy.png"))
    parser.add_argument(
        "--from-json", type=Path, help="summarise and plot a previous run's JSON instead of training"
    )
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        per_arm, settings = saved["runs"], saved["settings"]
    else:
        settings = {
            "teacher_top_k": args.teacher_top_k,
            "steps": args.steps,
            "rl_steps": args.rl_steps if args.rl_steps is not None else args.steps,
            "eval_steps": args.eval_steps,
            "seeds": args.seeds,
            "job": "examples/model_opd_tiny",
        }
        arm_names = [
            *args.arms,
            *(estimator_arm(name) for name in args.distill_losses),
            *(rl_lr_arm(lr) for lr in args.rl_learning_rates),
        ]
        per_arm = train_arms(
            arm_names,
            args.seeds,
            args.steps,
            args.eval_steps,
            args.teacher_top_k,
            rl_steps=args.rl_steps,
            # After every run, so a run cut short keeps its curves: `--from-json` summarises them.
            on_run=lambda runs: write_json(args.out, {"settings": settings, "partial": True, "runs": runs}),
        )
    per_arm = {name: seeds for name, seeds in per_arm.items() if seeds}
    arms = {name: summarize_arm(seeds) for name, seeds in per_arm.items()}
    print(format_table(arms, settings["steps"], settings.get("rl_steps")))
    rl_budget = settings.get("rl_steps", settings["steps"])
    for level in GAP_LEVELS:
        print(step_ratio(arms, rl_budget, level))
    plot(per_arm, args.plot)
    write_json(
        args.out,
        {
            "settings": settings,
            "headline_opd_arm": headline_opd_arm(arms),
            "best_rl_arm": best_rl_arm(arms),
            "arms": arms,
            "runs": per_arm,
        },
    )


def train_arms(
    arms: list[str],
    seeds: list[int],
    steps: int,
    eval_steps: int,
    teacher_top_k: int = 8,
    on_run: Callable[[dict[str, list[dict[str, Any]]]], None] | None = None,
    rl_steps: int | None = None,
) -> dict[str, list[dict[str, Any]]]:
    per_arm: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    # Seeds outermost: a run cut short still has every arm at the first seeds.
    for seed in seeds:
        for arm in arms:
            run = run_job(arm_spec(arm, seed, arm_steps(arm, steps, rl_steps), eval_steps, teacher_top_k))
            per_arm[arm].append(summarize_seed(run))
            last = per_arm[arm][-1]
            print(
                f"{arm} seed {seed}: {last['start']:.3f} -> {last['end']:.3f} in {last['wall_s']:.0f}s",
                flush=True,
            )
            if on_run is not None:
                on_run(per_arm)
    return per_arm


if __name__ == "__main__":
    main()
