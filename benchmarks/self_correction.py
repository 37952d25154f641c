"""Self-correction study (issue 54): does turn-level hindsight add task success to OPD, measured so a
gain of a few points could be seen? Arms as fresh jobs, every arm on every seed, same steps:

- `opd`: reverse KL to the teacher on the student's own turns (the example as written).
- `opd_hindsight`: the same plus the turn-level hindsight advantage (`hindsight_coef`).
- `opd_outcome_preference`: OPD plus outcome-level preference pairs (`preference_level: outcome`).
- `opd_turn_preference`: OPD plus the turn-level preference term (`turn_preference_coef`; its reference
  the frozen initial student, `turn_preference_reference: initial`, the job spec's default).
- `opd_turn_preference_beacons`: that plus verified hindsight beacons (`beacon_rewrite: teacher`,
  `beacon_temperature: 1.0`) trained as targets too (`beacon_sft_coef`); on the lookup task with the
  example's beacon writer (`LOOKUP_BEACON`) when its file exists, else the built-in rule.
- Controls: `opd_turn_preference_teacher_ref` (the teacher as the preference's reference, as the
  first study had it) and `opd_turn_preference_swapped` (chosen and rejected swapped: must not gain).
- `self_distill`: no larger teacher (`teacher_model: self`, the episode's reference in its context).

Stages (`--stage`, issue 54) pick the arms: `pilot` OPD alone (it must move >= +0.10 task success in its
budget first: `task_success_gain/opd`), `mechanism` OPD and turn preference on the first seed (read the
per-step `preference/*` series), `main` the four arms and two controls. `--settings` names arms instead.

Validation (`--task lookup`): a set generated into the results folder, no model rebuild: `--validation
-episodes` plain episodes (`lookup.make_episodes`) and `--injected-episodes` whose history already holds
a wrong call and its error (`lookup.make_injected_episodes`: self-correction). Each validation (greedy)
reports format validity, tool-call accuracy, turn success, task success, tool calls per trajectory,
self-correction success on the injected episodes, loops, and pass@k (`--pass-k` samples at
`--eval-temperature`); every sample's outcome is kept (`driver/validation.validation_outcomes`).

Headline: per arm, the paired absolute difference of task success against `opd` on the same seeds and
episodes, pooled over episodes x seeds, with a bootstrap 95 % interval (`paired_bootstrap.py`: seeds,
then episodes within each, resampled), at equal steps (`task_success_diff/<arm>`, `..._ci_low/<arm>`,
`..._ci_high/<arm>`, the last validation) and at equal training seconds (the same names with
`_at_equal_s`: each run's last validation within the shortest run's training seconds). The same for
turn success and format validity (`turn_success_diff/...`, `format_valid_diff/...`: the no-regression
check) and self-correction (`self_correction_diff/...`); `task_success_diff_half_width/<arm>` is what
the study can resolve. `task_success_ratio/<arm>` only where OPD's rate on that seed is >= 0.2. Each
run's record holds its per-step `preference/*`, `beacons/*`, `grad_norm/*`, reverse KL and reward.

Launch: `.venv/bin/python benchmarks/self_correction.py --task lookup --stage pilot --steps 40`
(after `opd make-tiny-models .cache/tiny-models-lookup --variant lookup`; CPU, the tiny models; a
320-episode validation with pass@4 costs far more than a step, so keep `--eval-every` coarse); the
`self_correction` task (the default, its models from `--variant self_correction`) generates its set the
same way (`self_correction.make_episodes`, about half hitting a moved item, and
`self_correction.make_injected_episodes`, the first call and the moved error already in the history).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import JobRun, job_spec, run_job, save_figure, write_json
from paired_bootstrap import RESAMPLES, Interval, paired_difference, pairs_of
from records import Pooled, add_publish_arguments, new_record, write_record

from opd_trainer.jsonl import write_jsonl

# The lookup example's beacon writer, added to the beacons arm only where its file exists (else the
# built-in rule for tool errors writes the beacons): (file in the workspace, classpath).
LOOKUP_BEACON = ("functions/beacon.py", "functions.beacon.LookupBeacon")
COMPONENT_RUNTIME = {
    "cpu": 0.25,
    "memory_size": 512,
    "concurrency": 64,
    "capacity": 1,
    "min_capacity": 1,
    "max_capacity": 1,
}


def lookup_validation(folder: Path, plain: int, injected: int, seed: int) -> list[Path]:
    """The lookup study's validation files, generated into `folder` (no model rebuild): `plain`
    episodes and `injected` episodes whose history holds a wrong call and its error."""
    from opd_trainer.demo.tool_routing import lookup

    return _validation_files(
        folder,
        lookup.make_episodes("validation", plain, seed) if plain else [],
        lookup.make_injected_episodes("validation", injected, seed) if injected else [],
    )


def self_correction_validation(folder: Path, plain: int, injected: int, seed: int) -> list[Path]:
    """The self-correction study's validation files, generated into `folder` (no model rebuild): `plain`
    episodes (about half hit a moved item) and `injected` ones whose history already holds the first
    call and the moved item's error."""
    from opd_trainer.demo.tool_routing import self_correction

    return _validation_files(
        folder,
        self_correction.make_episodes("validation", plain, seed) if plain else [],
        self_correction.make_injected_episodes("validation", injected, seed) if injected else [],
    )


def _validation_files(
    folder: Path, plain: list[dict[str, Any]], injected: list[dict[str, Any]]
) -> list[Path]:
    files = []
    for name, records in (("episodes", plain), ("injected", injected)):
        if records:
            path = folder / f"validation_{name}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_jsonl(path, records)
            files.append(path.resolve())
    return files


@dataclass(frozen=True)
class Task:
    """One task the study runs on: its job, models, record name, its repair share's metric, its beacon
    writer and how its validation set is generated (None: the job's own)."""

    job: Path
    models_dir: Path
    benchmark: str  # the record's name: each task its own, so neither overwrites the other
    repair: tuple[str, str]  # (figure name, validation metric) of the share that repaired an error
    beacon: tuple[str, str] | None = None
    validation: Callable[[Path, int, int, int], list[Path]] | None = None


TASKS = {
    "self_correction": Task(
        Path("examples/self_correction_agentic/job.yaml"),
        Path(".cache/tiny-models-self-correction"),
        "self_correction",
        ("self_corrected", "reward/episode/self_corrected"),
        validation=self_correction_validation,
    ),
    "lookup": Task(
        Path("examples/lookup_agentic/job.yaml"),
        Path(".cache/tiny-models-lookup"),
        "lookup_chain",
        ("repaired", "reward/episode/repaired"),
        beacon=LOOKUP_BEACON,
        validation=lookup_validation,
    ),
}
TURN_PREFERENCE = {"turn_preference_coef": 1.0}
SETTINGS: dict[str, dict[str, Any]] = {
    "opd": {},
    "opd_hindsight": {"hyper_parameters": {"hindsight_coef": 1.0}},
    "opd_outcome_preference": {
        "hyper_parameters": {"turn_preference_coef": 1.0, "preference_level": "outcome"}
    },
    "opd_turn_preference": {"hyper_parameters": TURN_PREFERENCE},
    "opd_turn_preference_beacons": {
        "hyper_parameters": {
            **TURN_PREFERENCE,
            "beacon_rewrite": "teacher",
            "beacon_temperature": 1.0,
            "beacon_sft_coef": 0.1,
        },
        "beacon_writer": True,
    },
    "opd_turn_preference_teacher_ref": {
        "hyper_parameters": {**TURN_PREFERENCE, "turn_preference_reference": "teacher"}
    },
    "opd_turn_preference_swapped": {"hyper_parameters": {**TURN_PREFERENCE, "turn_preference_swap": True}},
    "self_distill": {"teacher_model": "self", "hyper_parameters": {"teacher_hindsight": "reference"}},
}
BASE = "opd"
STAGES: dict[str, list[str]] = {
    "pilot": [BASE],
    "mechanism": [BASE, "opd_turn_preference"],
    "main": [
        BASE,
        "opd_outcome_preference",
        "opd_turn_preference",
        "opd_turn_preference_beacons",
        "opd_turn_preference_teacher_ref",
        "opd_turn_preference_swapped",
    ],
}
# The arms whose difference against OPD is the evidence (issue 54's proof).
MAIN_ARMS = ("opd_turn_preference", "opd_turn_preference_beacons")
PASS_K_METRIC = "pass_at_k"
# Per-step training metrics kept in each run: these prefixes, and these names.
SERIES_PREFIXES = ("preference/", "beacons/", "grad_norm/")
SERIES_NAMES = ("reverse_kl", "reward_mean", "time/step_s")
# The paired differences: figure stem -> (outcome numerator, denominator or None: per episode, subset).
PAIRED: dict[str, tuple[str, str | None, str | None]] = {
    "task_success_diff": ("success", None, None),
    "turn_success_diff": ("turns_succeeded", "turns", None),
    "format_valid_diff": ("turns_format_valid", "turns", None),
    "self_correction_diff": ("success", None, "wrong_history"),
}
EQUAL_S = "_at_equal_s"
# An outcome as kept in a run (compact: a study holds thousands): these fields, in this order.
OUTCOME_FIELDS = ("sample_id", "success", "turns", "turns_succeeded", "turns_format_valid", "wrong_history")
# Below this OPD rate a ratio against it means little (issue 54).
RATIO_MIN_BASE = 0.2


def metrics_of(task: Task) -> dict[str, str]:
    """Figure name -> validation metric of the study on `task`."""
    return {
        "task_success": "agent/task_success",
        "turn_success": "agent/turn_success",
        "format_valid_turns": "agent/format_valid_turns",
        "tool_call_accuracy": "agent/tool_call_accuracy",
        "tool_calls_per_trajectory": "agent/tool_calls_per_trajectory",
        "self_correction_success": "agent/self_correction_success",
        task.repair[0]: task.repair[1],
        "repeated_failing_call_share": "agent/repeated_failing_call_share",
        "recovery_after_error": "agent/recovery_after_error",
    }


def spec_for(
    task: Task, setting: str, args: argparse.Namespace, seed: int, validation: list[Path] | None = None
) -> Any:
    """The arm's job spec: the task's job with the setting's overrides, the study's validation options
    and overrides from the command line (`--learning-rate`, ...), and `validation` files if any."""
    base = job_spec(task.job, max_steps=args.steps, eval_steps=args.eval_every, seed=seed)
    data = base.model_dump()
    overrides = SETTINGS[setting]
    hp = data["hyper_parameters"]
    hp.update(overrides.get("hyper_parameters", {}))
    hp["eval_pass_k"] = args.pass_k
    hp["eval_temperature"] = args.eval_temperature
    for flag in ("learning_rate", "batch_size", "ppo_mini_batch_size", "n_rollouts"):
        if getattr(args, flag, None) is not None:
            hp[flag] = getattr(args, flag)
    for flag in ("turn_preference_coef", "beacon_sft_coef"):  # only where the arm has the term
        if getattr(args, flag, None) is not None and hp.get(flag):
            hp[flag] = getattr(args, flag)
    if "teacher_model" in overrides:
        data["teacher_model"] = overrides["teacher_model"]
    if validation:
        data["validation_datasets"] = [str(p) for p in validation]
    if overrides.get("beacon_writer") and task.beacon is not None:
        workspace = Path(data["functions"][0]["fcmodel"]["zipdir"])
        source, classpath = task.beacon
        if (workspace / source).is_file():
            data["functions"].append(
                {
                    "name": "beacon",
                    "type": "beacon",
                    "fcmodel": {"zipdir": str(workspace), "classpath": classpath},
                    "timeout": 60,
                    "runtime": COMPONENT_RUNTIME,
                }
            )
    return type(base).model_validate(data)


def _series(run: JobRun) -> list[dict[str, Any]]:
    """Per training step: the preference, beacon and gradient-norm metrics, reverse KL and reward."""
    return [
        {"step": r["step"]}
        | {k: v for k, v in r.items() if k.startswith(SERIES_PREFIXES) or k in SERIES_NAMES}
        for r in run.train
    ]


def measure(
    task: Task, setting: str, args: argparse.Namespace, seed: int, validation: list[Path] | None = None
) -> dict[str, Any]:
    run = run_job(spec_for(task, setting, args, seed, validation))
    k = args.pass_k
    curve = [
        {"step": r["step"], "train_s": run.train_s_until(r["step"])}
        | {name: r.get(key) for name, key in metrics_of(task).items()}
        | {PASS_K_METRIC: r.get(f"agent/pass_at_{k}") if k > 1 else None}
        for r in run.evals
    ]
    return {
        "setting": setting,
        "seed": seed,
        "train_s": run.train_s,
        "wall_s": run.wall_s,
        "beacon_pairs": sum(r.get("beacons/pairs", 0.0) for r in run.train),
        "preference_pairs": sum(r.get("preference/pairs", 0.0) for r in run.train),
        "step_s": statistics.median(r["time/step_s"] for r in run.train) if run.train else None,
        "final_reverse_kl": run.train[-1].get("reverse_kl") if run.train else None,
        "train_reward": [r.get("reward_mean") for r in run.train],
        "curve": curve,
        "series": _series(run),
        "outcomes": {
            str(step): [[o[f] for f in OUTCOME_FIELDS] for o in found] for step, found in run.outcomes.items()
        },
    }


def at_seconds(curve: list[dict[str, Any]], train_s: float, name: str) -> float | None:
    """The metric at the last validation a run had reached after `train_s` training seconds."""
    reached = [p for p in curve if p["train_s"] <= train_s + 1e-9 and p[name] is not None]
    return reached[-1][name] if reached else None


def step_at_seconds(run: dict[str, Any], train_s: float) -> int | None:
    """The step of the last validation `run` had reached after `train_s` training seconds."""
    reached = [p["step"] for p in run["curve"] if p["train_s"] <= train_s + 1e-9]
    return reached[-1] if reached else None


def outcomes_at(run: dict[str, Any], step: int | None) -> list[dict[str, Any]]:
    """The run's per-sample validation outcomes at `step` (empty when none were kept)."""
    if step is None:
        return []
    return [dict(zip(OUTCOME_FIELDS, row, strict=True)) for row in run.get("outcomes", {}).get(str(step), [])]


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.mean(present) if present else None


def _spread(values: list[float | None]) -> dict[str, float] | None:
    """Median and range over seeds (None when no seed has the value)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {"median": statistics.median(present), "min": min(present), "max": max(present)}


def _run(runs: list[dict[str, Any]], setting: str, seed: int) -> dict[str, Any] | None:
    mine = [r for r in runs if r["setting"] == setting and r["seed"] == seed and r["curve"]]
    return mine[0] if mine else None


def _final(runs: list[dict[str, Any]], setting: str, seed: int, name: str) -> float | None:
    run = _run(runs, setting, seed)
    return run["curve"][-1][name] if run else None


def paired(
    runs: list[dict[str, Any]], arm: str, seeds: list[int], stem: str, common_s: float | None, resamples: int
) -> tuple[Interval, list[float | None]]:
    """`arm` minus `opd` for the `PAIRED` metric `stem`, on each seed's same episodes: at the last
    validation (`common_s` None) or at each run's last validation within `common_s` training seconds.
    The pooled interval and each seed's own difference."""
    num, den, subset = PAIRED[stem]
    by_seed: dict[int, list[Any]] = {}
    per_seed: list[float | None] = []
    for seed in seeds:
        mine, base = _run(runs, arm, seed), _run(runs, BASE, seed)
        if mine is None or base is None:
            per_seed.append(None)
            continue
        steps = [
            r["curve"][-1]["step"] if common_s is None else step_at_seconds(r, common_s) for r in (mine, base)
        ]
        found = [outcomes_at(r, s) for r, s in zip((mine, base), steps, strict=True)]
        if subset is not None:
            found = [[o for o in f if o[subset]] for f in found]
        by_seed[seed] = pairs_of(found[0], found[1], num, den)
        per_seed.append(paired_difference({seed: by_seed[seed]}, resamples=1).estimate)
    return paired_difference(by_seed, resamples=resamples), per_seed


def summarise(task: Task, runs: list[dict[str, Any]]) -> dict[str, Any]:
    common_s = min(r["train_s"] for r in runs)
    table: dict[str, Any] = {"common_train_s": common_s}
    for setting in SETTINGS:
        mine = [r for r in runs if r["setting"] == setting]
        if not mine:
            continue
        row: dict[str, Any] = {
            "seeds": [r["seed"] for r in mine],
            "step_s": _mean([r["step_s"] for r in mine]),
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
                "mean_at_common_s": _mean(end),
                "final": final,
                "final_spread": _spread(final),
            }
        rewards = [r["train_reward"][-3:] for r in mine if r["train_reward"]]
        # Sampled episodes (temperature 1) of the last 3 training steps: greedy validation saturates first.
        row["train_reward_last3"] = [statistics.mean(v) for v in rewards if None not in v]
        table[setting] = row
    return table


def _colours() -> dict[str, str]:
    palette = (
        "tab:blue",
        "tab:orange",
        "tab:green",
        "tab:red",
        "tab:purple",
        "tab:brown",
        "tab:pink",
        "tab:grey",
    )
    return dict(zip(SETTINGS, palette, strict=True))


def plot(task: Task, runs: list[dict[str, Any]], path: Path) -> None:
    """Task success against step and against training seconds per arm and seed (an arm's seeds in its
    colour, one legend entry an arm), turn success against step, and the per-step preference accuracy,
    margin and pairs (beacon pairs dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = _colours()
    fig, axes = plt.subplots(2, 3, figsize=(17, 8.4))
    first_of_arm = {run["setting"]: run["seed"] for run in reversed(runs)}
    for run in runs:
        style = {"color": colours[run["setting"]], "alpha": 0.45 + 0.15 * (run["seed"] % 4)}
        # One legend entry per arm (its seeds share its colour); "_" hides the others' labels.
        label = run["setting"] if first_of_arm[run["setting"]] == run["seed"] else f"_{run['setting']}"
        for ax, x, name in (
            (axes[0][0], "step", "task_success"),
            (axes[0][1], "train_s", "task_success"),
            (axes[0][2], "step", "turn_success"),
        ):
            points = [p for p in run["curve"] if p[name] is not None]
            ax.plot([p[x] for p in points], [p[name] for p in points], marker="o", label=label, **style)
        for ax, name in ((axes[1][0], "preference/accuracy"), (axes[1][1], "preference/margin")):
            points = [p for p in run.get("series", []) if p.get(name) is not None]
            if points:
                ax.plot([p["step"] for p in points], [p[name] for p in points], label=label, **style)
        for name, line in (("preference/pairs", "-"), ("beacons/pairs", "--")):
            points = [p for p in run.get("series", []) if p.get(name) is not None]
            if points and any(p[name] for p in points):
                axes[1][2].plot(
                    [p["step"] for p in points],
                    [p[name] for p in points],
                    line,
                    label=f"{label} {name}",
                    **style,
                )
    titles = (
        ("step", "task success", "validation task success (greedy)"),
        ("training seconds", "task success", "validation task success at equal seconds"),
        ("step", "turn success", "validation turn success"),
        ("step", "preference accuracy", "chosen above rejected (share of pairs)"),
        ("step", "preference margin", "mean margin"),
        ("step", "pairs per step", "preference pairs (beacon pairs dashed)"),
    )
    for ax, (x, y, title) in zip(axes.flat, titles, strict=True):
        ax.set(xlabel=x, ylabel=y, title=title)
    fig.suptitle(f"{task.benchmark}: OPD arms on the same validation episodes")
    save_figure(fig, path)


def figures_of(
    task: Task, runs: list[dict[str, Any]], seeds: list[int], resamples: int
) -> tuple[dict[str, Any], list[str], list[str]]:
    """The record's figures, its headline and notes: per arm its metrics at the last validation (equal
    steps), its gain over its own start, and for every arm beside `opd` the paired differences with their
    intervals at equal steps and at equal training seconds."""
    figures: dict[str, Any] = {}
    settings = [s for s in SETTINGS if any(r["setting"] == s for r in runs)]
    for setting in settings:
        for name in (*metrics_of(task), PASS_K_METRIC):
            figures[f"{name}/{setting}"] = [_final(runs, setting, seed, name) for seed in seeds]
        starts = [(_run(runs, setting, s) or {"curve": [{}]})["curve"][0].get("task_success") for s in seeds]
        figures[f"task_success_gain/{setting}"] = [
            None if end is None or start is None else end - start
            for start, end in zip(starts, figures[f"task_success/{setting}"], strict=True)
        ]
        figures[f"wall_s/{setting}"] = [r["wall_s"] for r in runs if r["setting"] == setting]
    common_s = min(r["train_s"] for r in runs)
    detectable = []
    for arm in (s for s in settings if s != BASE):
        for stem in PAIRED:
            for suffix, at_s in (("", None), (EQUAL_S, common_s)):
                interval, per_seed = paired(runs, arm, seeds, stem, at_s, resamples)
                pooled = interval.seeds
                figures[f"{stem}{suffix}/{arm}"] = Pooled(interval.estimate, pooled)
                figures[f"{stem}_ci_low{suffix}/{arm}"] = Pooled(interval.low, pooled)
                figures[f"{stem}_ci_high{suffix}/{arm}"] = Pooled(interval.high, pooled)
                if stem == "task_success_diff":
                    figures[f"{stem}_per_seed{suffix}/{arm}"] = per_seed
                    figures[f"{stem}_half_width{suffix}/{arm}"] = Pooled(interval.half_width, pooled)
                    if not suffix and interval.half_width is not None:
                        detectable.append(
                            f"{arm}: task success {interval.estimate:+.3f} [{interval.low:+.3f}, "
                            f"{interval.high:+.3f}] over {interval.seeds} seeds x {interval.episodes} paired "
                            f"episode runs: a difference within +/-{interval.half_width:.3f} is not resolved"
                        )
        ratios = []
        for seed in seeds:
            arm_rate, base = _final(runs, arm, seed, "task_success"), _final(runs, BASE, seed, "task_success")
            ratios.append(
                arm_rate / base if arm_rate is not None and base and base >= RATIO_MIN_BASE else None
            )
        figures[f"task_success_ratio/{arm}"] = ratios
    arms = [a for a in settings if a != BASE]
    main = [a for a in arms if a in MAIN_ARMS] or arms
    headline = [f"task_success_diff{part}/{arm}" for arm in main for part in ("", "_ci_low", "_ci_high")] or [
        f"task_success_gain/{BASE}"
    ]
    return figures, headline, detectable


def write_study_record(
    task: Task, args: argparse.Namespace, runs: list[dict[str, Any]], argv: list[str]
) -> None:
    """The record (`figures_of`); each run without its per-sample outcomes (the `--out` file keeps them:
    a record re-made from it has the same intervals)."""
    figures, headline, detectable = figures_of(task, runs, args.seeds, args.resamples)
    record = new_record(
        task.benchmark,
        {k: v for k, v in vars(args).items() if k not in {"from_results"}},
        seeds=args.seeds,
        runs=[{k: v for k, v in r.items() if k != "outcomes"} for r in runs],
        figures=figures,
        headline=headline,
        models_dir=task.models_dir,
        notes=[
            "settings interleaved per seed (every setting of seed 0, then seed 1, ...), each a fresh job",
            f"validation: {args.validation_episodes} generated episodes + {args.injected_episodes} with an "
            f"injected wrong call and its error (seed {args.validation_seed}), greedy; pass@{args.pass_k} at "
            f"temperature {args.eval_temperature}"
            if task.validation is not None
            else "validation: the job's own episodes, greedy",
            f"paired differences against {BASE}: same seed, same episodes (by sample_id), pooled over "
            f"episodes x seeds; 95% bootstrap interval ({args.resamples} resamples, seeds then episodes, "
            f"one episode draw for every seed that ran the same episodes, RNG seed 0); '{EQUAL_S}' at each "
            "run's last validation within the shortest "
            "run's training seconds, else at the last validation (equal steps)",
            f"task_success_ratio only where {BASE}'s task success on the seed is >= {RATIO_MIN_BASE}",
            *detectable,
            *(
                [
                    f"runs re-read from {', '.join(map(str, args.from_results))}, written by the command "
                    "above (or by runs of it over parts of its arms and seeds)"
                ]
                if args.from_results
                else []
            ),
        ],
        argv=argv,
    )
    write_record(record, publish=args.publish, results_dir=args.results_dir, published_dir=args.published_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=list(TASKS), default="self_correction", help="episodes and models")
    parser.add_argument("--stage", choices=list(STAGES), default="main", help="which arms (module docstring)")
    parser.add_argument(
        "--settings", nargs="+", choices=list(SETTINGS), help="these arms instead of --stage's"
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--pass-k", type=int, default=4, help="validation pass@k samples (1: greedy only)")
    parser.add_argument("--eval-temperature", type=float, default=0.8, help="pass@k's sampling temperature")
    parser.add_argument("--validation-episodes", type=int, default=256, help="generated plain episodes")
    parser.add_argument("--injected-episodes", type=int, default=64, help="episodes with an injected error")
    parser.add_argument("--validation-seed", type=int, default=0, help="seed of the generated validation set")
    parser.add_argument("--resamples", type=int, default=RESAMPLES, help="bootstrap resamples")
    overrides = parser.add_argument_group("overrides of the job's hyper_parameters (default: the job's)")
    overrides.add_argument("--learning-rate", type=float)
    overrides.add_argument("--batch-size", type=int)
    overrides.add_argument("--n-rollouts", type=int)
    overrides.add_argument("--ppo-mini-batch-size", type=int)
    overrides.add_argument("--turn-preference-coef", type=float, help="in the arms that have the term")
    overrides.add_argument("--beacon-sft-coef", type=float, help="in the arms that have the term")
    parser.add_argument("--out", type=Path, help="default: <results dir>/<record name>.json")
    parser.add_argument(
        "--plot",
        type=Path,
        help="default: docs/images/<record name>.png with --publish, else the results dir",
    )
    parser.add_argument(
        "--from-results",
        type=Path,
        nargs="+",
        help="run nothing: record the runs of earlier runs' --out files, together (given the arguments "
        "that cover them: every arm and seed they hold)",
    )
    add_publish_arguments(parser)
    args = parser.parse_args()
    task = TASKS[args.task]
    if args.settings is None:
        args.settings = STAGES[args.stage]
        if args.stage == "mechanism":
            args.seeds = args.seeds[:1]
    args.out = args.out or args.results_dir / f"{task.benchmark}.json"
    args.plot = (
        args.plot or (Path("docs/images") if args.publish else args.results_dir) / f"{task.benchmark}.png"
    )
    argv = list(sys.argv)
    if args.from_results is not None:
        at = argv.index("--from-results")
        argv = argv[:at] + argv[at + 1 + len(args.from_results) :]  # the command that covers the runs
        runs = [run for path in args.from_results for run in json.loads(path.read_text())["runs"]]
        write_study_record(task, args, runs, argv)
        plot(task, runs, args.plot)
        return
    validation = None
    if task.validation is not None:
        folder = args.results_dir / f"{task.benchmark}_validation"
        validation = task.validation(
            folder, args.validation_episodes, args.injected_episodes, args.validation_seed
        )
        print(f"validation: {', '.join(str(p) for p in validation)}", flush=True)
    runs = []
    for seed in args.seeds:
        for setting in args.settings:
            runs.append(measure(task, setting, args, seed, validation))
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
