"""Ours vs TRL's on-policy distillation (GKD), repeated and interleaved, against TRL at its best.

Both train the same tiny student against the same teacher on the same prompts, in the same order (TRL
takes the batches our job's seeded order gives, `our_prompt_order`): each step takes `--batch-size`
prompts, samples one completion per prompt (up to `--max-new-tokens`, temperature 1) and makes one
optimizer update (AdamW, constant learning rate, no warm-up). Both validate greedily on the
same first `--eval-samples` validation records (default 100 of the tiny task's 200) with the same
evaluator, every `--eval-every` steps (default 2) and before the first step; a failed or cut-off sample
counts as wrong on both sides.

Every run is a fresh process (`--one-run ours|trl`, started by this script), so neither side inherits
the other's Ray, engines, threads or caches; each side's first training step is its warm-up (out of
samples/s on both sides, inside the time-to-target clock on both sides).

**How a figure is made, per seed in `--seeds` (default 0 1 2, one pair per seed):**

1. *Selection* (only where a side has more than one setting): every TRL setting (`--trl-betas`, default
   0 / 0.5 / 1 = forward KL / JSD / reverse KL, × `--trl-lrs`) and every setting of ours (each of
   `--estimators` × `--lrs`, default 5e-4 / 1e-4 / 2e-4 / 1e-3) runs once, the two sides alternating run by
   run. **The rule**: a side's best setting for the seed is the one with the fewest training seconds to
   reach validation exact match `--target-exact-match` (default 0.70); settings that never reach it rank
   after every one that did, by their highest exact match, then by samples/s. For ours this picks each
   estimator's best lr.
2. *Measurement*: with the chosen settings, the seed's pair runs fresh, interleaved: ours (each estimator),
   then TRL, so pairs go A, B, A, B, ... over the seeds. Per pair:
   - `time_to_target_ratio` = TRL's training seconds to the target / ours (> 1: ours is faster); a pair
     in which either side does not reach the target has no value (counted as `missing`);
   - `samples_per_s_ratio` = ours / TRL's samples per second of training-step time (step 1 excluded).
3. *Crossover*: per batch in `--crossover-batches`, `--pairs` pairs of `--crossover-steps`-step runs
   without validation (ours: the first estimator at `--lrs[0]`; TRL: `--trl-betas[0]`, `--trl-lrs[0]`),
   alternating, for `samples_per_s_ratio/batch<B>`.

The record (`records.py`) keeps every run's raw values and the selection, and names the headline figures
`time_to_target_ratio_median` and `samples_per_s_ratio_median` (the first estimator's pairs). A figure
from fewer than 3 pairs is recorded but not publishable.

Launch from the repository root (after `opd make-tiny-models .cache/tiny-models`, `bench` extra):
`.venv/bin/python benchmarks/vs_trl_gkd.py --publish` (batch 8; the record `vs_trl_gkd`) and
`.venv/bin/python benchmarks/vs_trl_gkd.py --batch-size 32 --crossover-batches --publish` (`vs_trl_gkd_b32`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from pathlib import Path
from typing import Any

from harness import JobRun, job_spec, run_job
from interleave import add_one_run_arguments, ratio, run_child, write_one_run
from records import add_publish_arguments, new_record, write_record

from opd_trainer.jobspec.dataset import EpochCursor
from opd_trainer.jobspec.estimators import DEFAULT_TEACHER_TOP_K
from opd_trainer.jobspec.job_spec import DEFAULT_DISTILL_LOSS
from opd_trainer.jsonl import read_jsonl, write_jsonl
from opd_trainer.learner.estimators import ESTIMATORS

SCRIPT = Path(__file__).resolve()
TRL_BETAS = [0.0, 0.5, 1.0]
# 1e-4 since TRL's best sat at 2e-4, the old grid's edge, on every seed; 2e-4 first: the crossover uses it
TRL_LRS = [2e-4, 1e-4, 5e-4, 1e-3]
OUR_LRS = [5e-4, 1e-4, 2e-4, 1e-3]  # the default (5e-4) first: the crossover runs use it


def ours(
    models_dir: Path,
    steps: int,
    batch: int,
    max_tokens: int,
    lr: float,
    eval_every: int,
    eval_file: Path | None,
    distill_loss: str = "sampled",
    teacher_top_k: int = 0,
    seed: int = 0,
) -> JobRun:
    spec = job_spec(
        distill_loss=distill_loss,
        teacher_top_k=teacher_top_k,
        max_steps=steps,
        batch_size=batch,
        n_rollouts=1,  # one completion per prompt, as GKD samples
        ppo_mini_batch_size=batch,  # one optimizer update per step, as GKD makes
        max_tokens=max_tokens,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_ratio=0.0,
        kl_coef=1.0,
        reward_coef=0.0,
        eval_steps=eval_every if eval_file else 10**6,
        seed=seed,  # data order, sampling seeds and the learner's torch seed
    )
    data = models_dir.resolve() / "data"
    update: dict[str, Any] = {
        "model": str(models_dir.resolve() / "student"),
        "teacher_model": str(models_dir.resolve() / "teacher"),
        "training_datasets": [str(data / "train.jsonl")],
        "validation_datasets": [str(eval_file)] if eval_file else [],
    }
    return run_job(spec.model_copy(update=update))


def top_k_for(estimator: str, teacher_top_k: int) -> int:
    """The teacher's top-k is paid for only where the estimator reads it."""
    return teacher_top_k if ESTIMATORS[estimator].needs_top_k else 0


def seconds_to(curve: list[dict[str, Any]], target: float) -> float | None:
    return next((p["train_s"] for p in curve if p["exact_match"] >= target), None)


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    """One run of ours (in this process): its raw values."""
    top_k = top_k_for(args.estimator, args.teacher_top_k)
    with tempfile.TemporaryDirectory() as scratch:
        eval_file = None
        if args.eval_every > 0:
            # Our validation on exactly the records TRL's side validates on.
            eval_file = Path(scratch) / "validation.jsonl"
            records = read_jsonl(args.models_dir / "data" / "validation.jsonl")[: args.eval_samples]
            write_jsonl(eval_file, records)
        run = ours(
            args.models_dir,
            args.steps,
            args.batch_size,
            args.max_new_tokens,
            args.lr,
            args.eval_every,
            eval_file,
            args.estimator,
            top_k,
            args.seed,
        )
    measured = run.train[1:] or run.train  # step 1 is the warm-up
    train_s = sum(r["time/step_s"] for r in measured)
    return {
        "side": "ours",
        "setting": {"estimator": args.estimator, "lr": args.lr, "teacher_top_k": top_k},
        "samples_per_s": sum(r["rollouts"] for r in measured) / train_s,
        "tokens_per_s": sum(r["trained_tokens"] for r in measured) / train_s,
        "step_s": [r["time/step_s"] for r in run.train],
        "curve": [{k: round(v, 4) for k, v in p.items()} for p in run.exact_match_curve()],
        "train_s": run.train_s,
        "wall_s": run.wall_s,
    }


def our_prompt_order(models_dir: Path, seed: int, steps: int, batch: int) -> list[int]:
    """The training records our job takes for `seed`, step by step (its `EpochCursor`): TRL takes the
    same, so a seed's pair trains on the same batches in the same order."""
    cursor = EpochCursor(len(read_jsonl(models_dir / "data" / "train.jsonl")), seed)
    return [index for _ in range(steps) for index in cursor.next_batch(batch)]


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    """One run of TRL's GKD (in this process): its raw values."""
    from trl_gkd import run_trl_gkd

    validating = args.eval_every > 0
    run = run_trl_gkd(
        args.models_dir,
        steps=args.steps,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        learning_rate=args.lr,
        eval_every=args.eval_every if validating else 10**6,
        eval_samples=args.eval_samples if validating else 1,  # it always validates at start and end
        seed=args.seed,
        beta=args.beta,
        prompt_order=our_prompt_order(args.models_dir, args.seed, args.steps, args.batch_size),
    )
    step_s, tokens = run.step_s[1:] or run.step_s, run.completion_tokens[1:] or run.completion_tokens
    curve = [
        {"step": e["step"], "exact_match": round(e["exact_match"], 4), "train_s": round(e["train_s"], 4)}
        for e in run.evals
    ]
    return {
        "side": "trl",
        "setting": {"beta": args.beta, "lr": args.lr},
        "samples_per_s": args.batch_size * len(step_s) / sum(step_s),
        "tokens_per_s": sum(tokens) / sum(step_s),
        "step_s": run.step_s,
        "curve": curve if validating else [],
        "train_s": run.train_s,
        "config": run.config,
    }


def child_args(args: argparse.Namespace, **override: Any) -> list[str]:
    """The command-line arguments of one child run: the shared settings, then this run's own."""
    values = {
        "models_dir": args.models_dir,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
        "eval_every": args.eval_every,
        "eval_samples": args.eval_samples,
        "teacher_top_k": args.teacher_top_k,
        **override,
    }
    return [str(x) for k, v in values.items() for x in (f"--{k.replace('_', '-')}", v)]


def rank(run: dict[str, Any], target: float) -> tuple[float, float, float]:
    """The selection rule's key (lower is better): seconds to the target; then, for runs that never
    reach it, the highest exact match; then samples/s."""
    reached = seconds_to(run["curve"], target)
    best = max((p["exact_match"] for p in run["curve"]), default=0.0)
    return (reached if reached is not None else float("inf"), -best, -run["samples_per_s"])


def alternate(a: list[Any], b: list[Any]) -> list[Any]:
    """a0, b0, a1, b1, ... then what is left of the longer list."""
    out = []
    for x, y in itertools.zip_longest(a, b):
        out += [v for v in (x, y) if v is not None]
    return out


def main_run(args: argparse.Namespace) -> None:
    ours_settings = {e: [{"estimator": e, "lr": lr} for lr in args.lrs] for e in args.estimators}
    trl_settings = [{"beta": b, "lr": lr} for b in args.trl_betas for lr in args.trl_lrs]
    runs: list[dict[str, Any]] = []
    selection: dict[str, dict[str, Any]] = {}

    def child(side: str, seed: int, phase: str, **override: Any) -> dict[str, Any]:
        setting = {k: v for k, v in override.items() if k in ("estimator", "lr", "beta")}
        result = run_child(SCRIPT, side, child_args(args, seed=seed, **override))
        result.update(seed=seed, phase=phase, batch_size=override.get("batch_size", args.batch_size))
        result["setting"] = {**setting, **result["setting"]}
        runs.append(result)
        print(
            f"[vs_trl_gkd] {phase} {side} seed {seed} {json.dumps(result['setting'])}: "
            f"{result['samples_per_s']:.2f} samples/s, curve "
            f"{' / '.join(format(p['exact_match'], '.2f') for p in result['curve'])}",
            flush=True,
        )
        return result

    # Measured pairs: per seed, ours (each estimator's chosen lr), then TRL's chosen setting.
    pairs: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {e: [] for e in args.estimators}
    for seed in args.seeds:
        chosen: dict[str, Any] = {}
        sweeps = {e: s for e, s in ours_settings.items() if len(s) > 1}
        if sweeps or len(trl_settings) > 1:
            ours_jobs = [("ours", s) for e in sweeps for s in ours_settings[e]]
            trl_jobs = [("trl", s) for s in trl_settings] if len(trl_settings) > 1 else []
            swept = [
                (side, child(side, seed, "selection", **s)) for side, s in alternate(ours_jobs, trl_jobs)
            ]
            for e in sweeps:
                candidates = [r for side, r in swept if side == "ours" and r["setting"]["estimator"] == e]
                chosen[e] = min(candidates, key=lambda r: rank(r, args.target_exact_match))["setting"]
            if trl_jobs:
                candidates = [r for side, r in swept if side == "trl"]
                chosen["trl"] = min(candidates, key=lambda r: rank(r, args.target_exact_match))["setting"]
        for e in args.estimators:
            chosen.setdefault(e, ours_settings[e][0])
        chosen.setdefault("trl", trl_settings[0])
        selection[str(seed)] = {
            k: {"beta": v["beta"], "lr": v["lr"]} if k == "trl" else {"estimator": k, "lr": v["lr"]}
            for k, v in chosen.items()
        }
        ours_runs = {
            e: child("ours", seed, "measure", estimator=e, lr=chosen[e]["lr"]) for e in args.estimators
        }
        trl_run = child("trl", seed, "measure", beta=chosen["trl"]["beta"], lr=chosen["trl"]["lr"])
        for e in args.estimators:
            pairs[e].append((ours_runs[e], trl_run))

    target = args.target_exact_match
    figures: dict[str, list[float | None]] = {}
    for i, e in enumerate(args.estimators):
        suffix = "" if i == 0 else f"/{e}"
        figures[f"time_to_target_ratio{suffix}"] = [
            ratio(seconds_to(t["curve"], target), seconds_to(o["curve"], target)) for o, t in pairs[e]
        ]
        figures[f"samples_per_s_ratio{suffix}"] = [
            ratio(o["samples_per_s"], t["samples_per_s"]) for o, t in pairs[e]
        ]
        figures[f"tokens_per_s_ratio{suffix}"] = [
            ratio(o["tokens_per_s"], t["tokens_per_s"]) for o, t in pairs[e]
        ]
        figures[f"ours_train_s_to_target{suffix}"] = [seconds_to(o["curve"], target) for o, _ in pairs[e]]
        figures[f"ours_samples_per_s{suffix}"] = [o["samples_per_s"] for o, _ in pairs[e]]
    first = args.estimators[0]
    figures["trl_train_s_to_target"] = [seconds_to(t["curve"], target) for _, t in pairs[first]]
    figures["trl_samples_per_s"] = [t["samples_per_s"] for _, t in pairs[first]]

    crossover_seed = args.seeds[0]
    for batch in args.crossover_batches:
        values: list[float | None] = []
        for _ in range(args.pairs):
            common = {"steps": args.crossover_steps, "batch_size": batch, "eval_every": 0}
            o = child("ours", crossover_seed, "crossover", estimator=first, lr=args.lrs[0], **common)
            t = child(
                "trl", crossover_seed, "crossover", beta=args.trl_betas[0], lr=args.trl_lrs[0], **common
            )
            values.append(ratio(o["samples_per_s"], t["samples_per_s"]))
        figures[f"samples_per_s_ratio/batch{batch}"] = values

    child_only = {"one_run", "one_run_out", "seed", "lr", "beta", "estimator"}
    record = new_record(
        args.name,
        {k: v for k, v in vars(args).items() if k not in child_only},
        seeds=args.seeds,
        runs=runs,
        figures=figures,
        headline=["time_to_target_ratio", "samples_per_s_ratio"],
        models_dir=args.models_dir,
        notes=[
            f"target exact match {target} on the first {args.eval_samples} validation records, every "
            f"{args.eval_every} steps; one measured pair per seed, ours then TRL",
            "selection (best setting per seed and side, by the rule in the script's docstring): "
            + json.dumps(selection),
        ],
    )
    record_runs = len(runs)
    write_record(record, publish=args.publish, results_dir=args.results_dir, published_dir=args.published_dir)
    print(format_table(record.figures, record_runs))


def format_table(figures: dict[str, dict[str, Any]], runs: int) -> str:
    lines = [f"{'figure':<40}{'median':>9}{'min':>9}{'max':>9}{'runs':>6}{'missing':>9}  ({runs} processes)"]
    for name, s in figures.items():
        cells = "".join(
            f"{'—' if s[k] is None else format(s[k], '.3f'):>9}" for k in ("median", "min", "max")
        )
        lines.append(f"{name:<40}{cells}{s['runs']:>6}{s['missing']:>9}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=Path(".cache/tiny-models"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=2, help="0: no validation")
    parser.add_argument(
        "--eval-samples", type=int, default=100, help="the first N of the 200 validation records"
    )
    parser.add_argument("--target-exact-match", type=float, default=0.70)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one measured pair per seed")
    parser.add_argument("--pairs", type=int, default=3, help="pairs per crossover batch size")
    parser.add_argument("--crossover-batches", type=int, nargs="*", default=[8, 32])
    parser.add_argument("--crossover-steps", type=int, default=6)
    parser.add_argument(
        "--estimators",
        nargs="+",
        default=[DEFAULT_DISTILL_LOSS],
        choices=list(ESTIMATORS),
        help="our distill_loss values, each paired with the same TRL runs; the first makes the headline",
    )
    parser.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=OUR_LRS,
        help="our lr grid (per estimator, swept as TRL's is); the first is the crossover runs'",
    )
    parser.add_argument("--trl-betas", type=float, nargs="+", default=TRL_BETAS, help="TRL GKD's beta grid")
    parser.add_argument("--trl-lrs", type=float, nargs="+", default=TRL_LRS, help="TRL's lr grid")
    parser.add_argument(
        "--teacher-top-k",
        type=int,
        default=DEFAULT_TEACHER_TOP_K,
        help="teacher_top_k of every estimator that reads the teacher's top-k",
    )
    parser.add_argument(
        "--name", default=None, help="record name (default vs_trl_gkd, or vs_trl_gkd_b<batch>)"
    )
    add_publish_arguments(parser)
    add_one_run_arguments(parser, ["ours", "trl"])
    # One child run's own settings (set by the parent).
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--lr", type=float, default=5e-4, help=argparse.SUPPRESS)
    parser.add_argument("--beta", type=float, default=1.0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--estimator", default=DEFAULT_DISTILL_LOSS, choices=list(ESTIMATORS), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.one_run:
        result = run_ours(args) if args.one_run == "ours" else run_trl(args)
        write_one_run(args.one_run_out, result)
        return
    args.name = args.name or ("vs_trl_gkd" if args.batch_size == 8 else f"vs_trl_gkd_b{args.batch_size}")
    main_run(args)


if __name__ == "__main__":
    main()
