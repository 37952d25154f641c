"""Self-correction study: OPD vs OPD + turn-level hindsight vs OPD + outcome- or turn-level preference
pairs (with or without hindsight beacons) vs hindsight self-distillation, 3 seeds.

The job is `examples/self_correction_agentic/job.yaml` (an agent whose tool calls sometimes hit a moved
item and must be repeated on the new id) on the `self_correction` tiny models. Five settings, each for
every seed, same steps (so about the same training time: the learner and both engines do the same
work in each):

- `opd`: reverse KL to the teacher on the student's own turns (the example as written).
- `opd_hindsight`: the same plus the turn-level hindsight advantage (`hindsight_coef`): at the first
  turn where a failed episode parted from a successful sibling, +/- on that turn's tokens.
- `opd_outcome_preference`: OPD plus outcome-level preference pairs (`preference_level: outcome`): the
  whole better episode preferred over the whole worse one (DPO against the teacher's scoring).
- `opd_turn_preference`: OPD plus the turn-level preference term (`turn_preference_coef`): the same
  parting turns as DPO pairs, the better answer preferred over the worse.
- `opd_turn_preference_beacons`: the turn-level preference term plus hindsight beacons
  (`beacon_rewrite: teacher`, `beacon_temperature: 1.0`): each turn whose call got an error is written
  again by the teacher reading what the tool answered, and the rewrite is preferred over the turn.
  Seed 003's four-arm ablation is `opd`, `opd_outcome_preference`, `opd_turn_preference` and this one
  (`--settings`).
- `self_distill`: no larger teacher: `teacher_model: self` (the frozen initial student) scoring with the
  episode's reference calls in its context (`teacher_hindsight: reference`).

Validation (64 held-out episodes, greedy; with `--pass-k K` also K samples per episode at temperature 1)
reports agent-level task success, pass@K, turn success, the share of episodes that hit a moved item's
error and corrected themselves in the next turn, and the loop share (a failing call made again). The
result is compared at the same training seconds (the shortest run's), start-up and evaluation excluded,
as the median over seeds with its range.

`--task lookup` runs the same settings on the lookup episodes instead (`examples/lookup_agentic/job.yaml`
on the `lookup` tiny models: the agent must call find_item, then the tool on the id it returned, and
repair its own wrong early turns); its record is `lookup_chain`, its repair share `repaired` (episodes
that hit an error and still succeeded) in place of `self_corrected`.

Launch: `.venv/bin/python benchmarks/self_correction.py --steps 20 --seeds 0 1 2`
(after `opd make-tiny-models .cache/tiny-models-self-correction --variant self_correction`), or with
`--task lookup` (after `opd make-tiny-models .cache/tiny-models-lookup --variant lookup`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import job_spec, run_job, save_figure, write_json
from records import add_publish_arguments, new_record, write_record


@dataclass(frozen=True)
class Task:
    """One task the study runs on: its job, models, record name and its repair share's metric."""

    job: Path
    models_dir: Path
    benchmark: str  # the record's name: each task its own, so neither overwrites the other
    repair: tuple[str, str]  # (figure name, validation metric) of the share that repaired an error


TASKS = {
    "self_correction": Task(
        Path("examples/self_correction_agentic/job.yaml"),
        Path(".cache/tiny-models-self-correction"),
        "self_correction",
        ("self_corrected", "reward/episode/self_corrected"),
    ),
    "lookup": Task(
        Path("examples/lookup_agentic/job.yaml"),
        Path(".cache/tiny-models-lookup"),
        "lookup_chain",
        ("repaired", "reward/episode/repaired"),
    ),
}
SETTINGS: dict[str, dict[str, Any]] = {
    "opd": {},
    "opd_hindsight": {"hyper_parameters": {"hindsight_coef": 1.0}},
    "opd_outcome_preference": {
        "hyper_parameters": {"turn_preference_coef": 1.0, "preference_level": "outcome"}
    },
    "opd_turn_preference": {"hyper_parameters": {"turn_preference_coef": 1.0}},
    "opd_turn_preference_beacons": {
        "hyper_parameters": {
            "turn_preference_coef": 1.0,
            "beacon_rewrite": "teacher",
            "beacon_temperature": 1.0,
        }
    },
    "self_distill": {"teacher_model": "self", "hyper_parameters": {"teacher_hindsight": "reference"}},
}
PASS_K_METRIC = "pass_at_k"


def metrics_of(task: Task) -> dict[str, str]:
    """Figure name -> validation metric of the study on `task`."""
    return {
        "task_success": "agent/task_success",
        "turn_success": "agent/turn_success",
        task.repair[0]: task.repair[1],
        "tool_call_accuracy": "agent/tool_call_accuracy",
        "repeated_failing_call_share": "agent/repeated_failing_call_share",
        "recovery_after_error": "agent/recovery_after_error",
    }


def spec_for(task: Task, setting: str, steps: int, eval_every: int, seed: int, pass_k: int = 1) -> Any:
    base = job_spec(task.job, max_steps=steps, eval_steps=eval_every, seed=seed)
    data = base.model_dump()
    overrides = SETTINGS[setting]
    data["hyper_parameters"].update(overrides.get("hyper_parameters", {}))
    data["hyper_parameters"]["eval_pass_k"] = pass_k
    if "teacher_model" in overrides:
        data["teacher_model"] = overrides["teacher_model"]
    return type(base).model_validate(data)


def measure(
    task: Task, setting: str, steps: int, eval_every: int, seed: int, pass_k: int = 1
) -> dict[str, Any]:
    run = run_job(spec_for(task, setting, steps, eval_every, seed, pass_k))
    curve = [
        {"step": r["step"], "train_s": run.train_s_until(r["step"])}
        | {name: r.get(key) for name, key in metrics_of(task).items()}
        | {PASS_K_METRIC: r.get(f"agent/pass_at_{pass_k}")}
        for r in run.evals
    ]
    return {
        "setting": setting,
        "seed": seed,
        "train_s": run.train_s,
        "wall_s": run.wall_s,
        "beacon_pairs": sum(r.get("beacons/pairs", 0.0) for r in run.train),
        "preference_pairs": sum(r.get("preference/pairs", 0.0) for r in run.train),
        "step_s": statistics.median(r["time/step_s"] for r in run.train),
        "final_reverse_kl": run.train[-1]["reverse_kl"],
        "train_reward": [r.get("reward_mean") for r in run.train],
        "curve": curve,
    }


def at_seconds(curve: list[dict[str, Any]], train_s: float, name: str) -> float | None:
    """The metric at the last validation a run had reached after `train_s` training seconds."""
    reached = [p for p in curve if p["train_s"] <= train_s + 1e-9 and p[name] is not None]
    return reached[-1][name] if reached else None


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.mean(present) if present else None


def _spread(values: list[float | None]) -> dict[str, float] | None:
    """Median and range over seeds (None when no seed has the value)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {"median": statistics.median(present), "min": min(present), "max": max(present)}


def summarise(task: Task, runs: list[dict[str, Any]]) -> dict[str, Any]:
    common_s = min(r["train_s"] for r in runs)
    table: dict[str, Any] = {"common_train_s": common_s}
    for setting in SETTINGS:
        mine = [r for r in runs if r["setting"] == setting]
        if not mine:
            continue
        row: dict[str, Any] = {
            "seeds": [r["seed"] for r in mine],
            "step_s": statistics.median(r["step_s"] for r in mine),
            "wall_s": _spread([r.get("wall_s") for r in mine]),
            "beacon_pairs": [r.get("beacon_pairs") for r in mine],
            "preference_pairs": [r.get("preference_pairs") for r in mine],
        }
        for name in (*metrics_of(task), PASS_K_METRIC):
            start = [r["curve"][0][name] if r["curve"] else None for r in mine]
            end = [at_seconds(r["curve"], common_s, name) for r in mine]
            final = [r["curve"][-1][name] if r["curve"] else None for r in mine]  # equal steps and samples
            row[name] = {
                "start": start,
                "at_common_s": end,
                "mean_start": _mean(start),
                "mean_at_common_s": _mean(end),
                "at_common_s_spread": _spread(end),
                "final": final,
                "final_spread": _spread(final),
            }
        # Sampled episodes (temperature 1) of the last 3 training steps: greedy validation saturates first.
        row["train_reward_last3"] = {
            "per_seed": [statistics.mean(r["train_reward"][-3:]) for r in mine],
            "mean": statistics.mean(statistics.mean(r["train_reward"][-3:]) for r in mine),
        }
        table[setting] = row
    return table


def plot(task: Task, runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    palette = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
    colours = dict(zip(SETTINGS, palette, strict=True))
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for run in runs:
        axes[3].plot(
            range(1, len(run["train_reward"]) + 1),
            run["train_reward"],
            color=colours[run["setting"]],
            alpha=0.45 + 0.2 * (run["seed"] % 3),
            label=f"{run['setting']} seed {run['seed']}",
        )
    axes[3].set(xlabel="step", ylabel="mean episode reward", title="training episodes (temperature 1)")
    for ax, name in zip(axes[:3], ("task_success", "turn_success", task.repair[0]), strict=True):
        for run in runs:
            points = [p for p in run["curve"] if p[name] is not None]
            ax.plot(
                [p["train_s"] for p in points],
                [p[name] for p in points],
                marker="o",
                color=colours[run["setting"]],
                alpha=0.45 + 0.2 * (run["seed"] % 3),
                label=f"{run['setting']} seed {run['seed']}",
            )
        ax.set(xlabel="training seconds", ylabel=name.replace("_", " "), title=f"validation {name}")
    save_figure(fig, path)


def _final(runs: list[dict[str, Any]], setting: str, seed: int, name: str) -> float | None:
    mine = [r for r in runs if r["setting"] == setting and r["seed"] == seed and r["curve"]]
    return mine[0]["curve"][-1][name] if mine else None


def _gain(runs: list[dict[str, Any]], setting: str, seeds: list[int]) -> list[float | None]:
    """Per seed, `setting`'s final task success over `opd`'s (same seed, equal steps and samples)."""
    gains: list[float | None] = []
    for seed in seeds:
        arm, base = _final(runs, setting, seed, "task_success"), _final(runs, "opd", seed, "task_success")
        gains.append(arm / base if arm is not None and base else None)
    return gains


def write_study_record(
    task: Task, args: argparse.Namespace, runs: list[dict[str, Any]], argv: list[str]
) -> None:
    """The record: per setting its final (equal steps) task success, pass@k, turn success, repair
    (self-correction) and loop shares, wall seconds, and its task success over `opd`'s per seed (the
    headline)."""
    figures: dict[str, list[float | None]] = {}
    settings = [s for s in SETTINGS if any(r["setting"] == s for r in runs)]
    for setting in settings:
        for name in (
            "task_success",
            PASS_K_METRIC,
            "turn_success",
            task.repair[0],
            "repeated_failing_call_share",
        ):
            figures[f"{name}/{setting}"] = [_final(runs, setting, seed, name) for seed in args.seeds]
        figures[f"wall_s/{setting}"] = [r["wall_s"] for r in runs if r["setting"] == setting]
        if setting != "opd":
            figures[f"task_success_ratio/{setting}"] = _gain(runs, setting, args.seeds)
    record = new_record(
        task.benchmark,
        {k: v for k, v in vars(args).items() if k not in {"from_results"}},
        seeds=args.seeds,
        runs=runs,
        figures=figures,
        headline=[f for f in figures if f.startswith("task_success_ratio/")],
        models_dir=task.models_dir,
        notes=[
            "settings interleaved per seed (every setting of seed 0, then seed 1, ...), each a fresh job",
            "figures at the last validation (equal steps and samples); the JSON results also compare them "
            "at the shortest run's training seconds",
            *(
                [f"runs re-read from {args.from_results}, written by the command above"]
                if args.from_results
                else []
            ),
        ],
        argv=argv,
    )
    write_record(record, publish=args.publish, results_dir=args.results_dir, published_dir=args.published_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--pass-k", type=int, default=1, help="validation pass@k samples (1: greedy only)")
    parser.add_argument("--task", choices=list(TASKS), default="self_correction", help="episodes and models")
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/<record name>.json")
    parser.add_argument("--plot", type=Path, help="default: docs/images/<record name>.png")
    parser.add_argument(
        "--from-results",
        type=Path,
        help="run nothing: record the runs of an earlier run's --out file (given the same arguments)",
    )
    add_publish_arguments(parser)
    args = parser.parse_args()
    task = TASKS[args.task]
    args.out = args.out or Path(f"benchmarks/results/{task.benchmark}.json")
    args.plot = args.plot or Path(f"docs/images/{task.benchmark}.png")
    argv = list(sys.argv)
    if args.from_results is not None:
        at = argv.index("--from-results")
        argv = argv[:at] + argv[at + 2 :]  # the command that made the runs
        runs = json.loads(args.from_results.read_text())["runs"]
        write_study_record(task, args, runs, argv)
        plot(task, runs, args.plot)
        return
    runs = []
    for seed in args.seeds:
        for setting in args.settings:
            runs.append(measure(task, setting, args.steps, args.eval_every, seed, args.pass_k))
            last = runs[-1]["curve"][-1] if runs[-1]["curve"] else {}
            print(
                json.dumps({"setting": setting, "seed": seed, "train_s": runs[-1]["train_s"], **last}),
                flush=True,
            )
            write_json(args.out, {"runs": runs, "summary": summarise(task, runs)})
    plot(task, runs, args.plot)
    print(json.dumps(summarise(task, runs), indent=2))
    write_study_record(task, args, runs, argv)


if __name__ == "__main__":
    main()
