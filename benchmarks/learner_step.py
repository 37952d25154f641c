"""The learner's update alone: one rank's `train_step` on a fixed mini-batch, repeated, in this process.

A job's step times the learner beside the engines, the gateway and Ray on the same cores, so a change to
the learner's own work hides in their noise; this times only `Learner.train_step` (DeepSpeed, CPU
accelerator) on a batch shaped like the tiny task's: the first `--rows / --n-rollouts` training records'
prompts as the student's chat template renders them (a shared system and tools preamble, prompts of
different lengths), `--n-rollouts` completions each with lengths drawn from 1 to `--max-new-tokens`
(seeded), the teacher's scores and top-k at every completion position. Token ids and scores are random
(seeded): the update's work depends on the shapes, not the values.

Launch: `.venv/bin/python benchmarks/learner_step.py` (after `opd make-tiny-models .cache/tiny-models`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from harness import learner_settings


def prompts_of(models_dir: Path, count: int) -> list[list[int]]:
    """The first `count` training records' prompts, rendered as the student's chat template does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(models_dir / "student"))
    prompts = []
    with (models_dir / "data" / "train.jsonl").open() as lines:
        for line, _ in zip(lines, range(count), strict=False):
            record = json.loads(line)
            text = tokenizer.apply_chat_template(
                record["messages"], tools=record.get("tools"), add_generation_prompt=True, tokenize=False
            )
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def segments(prompts: list[list[int]], n_rollouts: int, max_tokens: int, top_k: int, vocab: int) -> list[Any]:
    """`n_rollouts` scored completions of each prompt (random ids and scores, seeded)."""
    from opd_trainer.records import LLMCall

    rng = np.random.default_rng(0)
    out = []
    for group, prompt in enumerate(prompts):
        for _ in range(n_rollouts):
            length = int(rng.integers(1, max_tokens + 1))
            out.append(
                LLMCall(
                    prompt_token_ids=prompt,
                    completion_token_ids=rng.integers(3, vocab, size=length).tolist(),
                    sampler_logprobs=(-rng.random(length) * 3).tolist(),
                    teacher_logprobs=(-rng.random(length) * 3).tolist(),
                    teacher_top_ids=rng.integers(0, vocab, size=(length, top_k)).astype(np.int32),
                    teacher_top_logprobs=np.sort(-rng.random((length, top_k)) * 5, axis=1)[:, ::-1].astype(
                        np.float32
                    ),
                    group_id=group,
                    rollout_id=len(out),
                )
            )
    return out


def learner(args: argparse.Namespace) -> Any:
    """A one-rank learner of the student with the job defaults this benchmark's arguments leave."""
    from opd_trainer.learner.deepspeed_learner import Learner

    settings = learner_settings(
        str(args.models_dir / "student"),
        zero_stage=args.zero_stage,
        distill_loss=args.estimator,
        teacher_top_k=args.teacher_top_k,
        total_updates=args.warmup + args.repeats,
        learning_rate=5e-4,
    )
    rank = Learner(settings)
    rank.initialize()
    return rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=Path(".cache/tiny-models"))
    parser.add_argument("--rows", type=int, default=8, help="completions in the mini-batch")
    parser.add_argument("--n-rollouts", type=int, default=1, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--teacher-top-k", type=int, default=8)
    parser.add_argument("--estimator", default="topk_forward")
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3, help="updates before timing")
    parser.add_argument("--repeats", type=int, default=15, help="timed updates")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/learner_step.json"))
    args = parser.parse_args()
    if args.rows % args.n_rollouts:
        raise SystemExit(f"--rows ({args.rows}) must be a multiple of --n-rollouts ({args.n_rollouts})")
    vocab = json.loads((args.models_dir / "student" / "config.json").read_text())["vocab_size"]
    batch = segments(
        prompts_of(args.models_dir, args.rows // args.n_rollouts),
        args.n_rollouts,
        args.max_new_tokens,
        args.teacher_top_k,
        vocab,
    )
    rank = learner(args)
    for _ in range(args.warmup):
        rank.train_step([batch])
    seconds = []
    for index in range(args.repeats):
        started = time.perf_counter()
        metrics = rank.train_step([batch])
        seconds.append(time.perf_counter() - started)
        print(f"update {index + 1}/{args.repeats}: {seconds[-1] * 1000:.1f} ms", flush=True)
    result = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": len(batch),
        "prompt_tokens": [len(s.prompt_token_ids) for s in batch[:: args.n_rollouts]],
        "completion_tokens": [len(s.completion_token_ids) for s in batch],
        "learner_tokens": metrics["learner_tokens"],
        "train_step_s": statistics.median(seconds),
        "train_step_min_s": min(seconds),
        "train_step_all_s": seconds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    median_ms, min_ms = result["train_step_s"] * 1000, result["train_step_min_s"] * 1000
    print(f"train_step median {median_ms:.1f} ms (min {min_ms:.1f})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
