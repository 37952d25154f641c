"""Where a learner rank's host memory goes: process RSS of one `Learner` (world size 1, DeepSpeed's CPU
accelerator, fp32) after each phase of its life, and the peak inside each phase, in bytes per parameter.

Phases: the model and optimizer built (just before `deepspeed.initialize`), `deepspeed.initialize`, the
first update's forward (up to `engine.backward`), backward (up to `engine.step`), step, a second whole
update (the optimizer's moments exist from the first step on: its peak is the steady state), and
`named_weights` + `export_weights(["shm"])` (full training). The mini-batch is `learner_step.py`'s:
`--rows` completions of `--rows / --n-rollouts` training prompts, lengths drawn from 1 to
`--max-new-tokens`, the teacher's top-k at every position (the job's defaults: 8 rows, 4 rollouts a
prompt, 256 tokens, top-8, topk_forward). Peaks are the kernel's high-water mark (`VmHWM`), reset at
every phase boundary (`/proc/self/clear_refs`), so a transient copy inside a phase is seen. fp32 AdamW
needs 16 bytes a trained parameter (weights, gradients, two moments); "B/param" is the RSS above the
process's before the model was loaded, over the model's parameters.

Launch (one measurement a process; a ~0.5B model needs ~10-20 GB free):
    .venv/bin/python benchmarks/make_random_model.py /tmp/rnd-500m
    .venv/bin/python benchmarks/learner_memory.py --models-dir /tmp/rnd-500m --zero-stage 2
Linux only (reads /proc); CPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import learner_settings
from learner_step import prompts_of, segments


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(match.group(1)) if match else 0


class Phases:
    """RSS at each phase boundary and the peak since the previous one (VmHWM, reset at each mark)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._reset_peak()

    @staticmethod
    def _reset_peak() -> None:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS

    def mark(self, phase: str) -> None:
        self.rows.append(
            {"phase": phase, "rss": _status_kib("VmRSS") * 1024, "peak": _status_kib("VmHWM") * 1024}
        )
        self._reset_peak()


def watchdog(limit_bytes: int) -> None:
    """Ends this process (exit 3) once its RSS passes `limit_bytes`: a shared machine's other work is
    not put at risk of the kernel's OOM killer by a measurement."""
    import threading
    import time

    def watch() -> None:
        while True:
            rss = _status_kib("VmRSS") * 1024
            if rss > limit_bytes:
                print(f"RSS {rss / 2**30:.1f} GiB passed --max-rss-gb: stopped", flush=True)
                os._exit(3)
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()


def instrument(learner: Any, phases: Phases) -> None:
    """Marks a phase where the learner enters `deepspeed.initialize`, `engine.backward`, `engine.step`."""
    import deepspeed

    initialize = deepspeed.initialize

    def marked_initialize(*args: Any, **kwargs: Any) -> Any:
        phases.mark("model + optimizer built")
        deepspeed.initialize = initialize
        result = initialize(*args, **kwargs)
        phases.mark("deepspeed.initialize")
        engine = result[0]
        backward, step = engine.backward, engine.step

        def marked_backward(*a: Any, **k: Any) -> Any:
            if not phases.rows[-1]["phase"].startswith(("forward", "backward", "step")):
                phases.mark("forward")
            out = backward(*a, **k)
            return out

        def marked_step(*a: Any, **k: Any) -> Any:
            if phases.rows[-1]["phase"] == "forward":
                phases.mark("backward")
            return step(*a, **k)

        engine.backward, engine.step = marked_backward, marked_step
        return result

    deepspeed.initialize = marked_initialize


def learner_of(args: argparse.Namespace) -> Any:
    from opd_trainer.learner.deepspeed_learner import Learner
    from opd_trainer.learner.settings import LoraAdapter

    settings = learner_settings(
        str(args.models_dir / "student"),
        zero_stage=args.zero_stage,
        distill_loss=args.estimator,
        teacher_top_k=args.teacher_top_k,
        total_updates=2,
        lora=LoraAdapter(args.lora_r, 2.0 * args.lora_r, 0.0, ("q_proj", "k_proj", "v_proj", "o_proj"))
        if args.lora_r
        else None,
        gradient_checkpointing=args.gradient_checkpointing,
        optimizer_offload=args.optimizer_offload,
    )
    return Learner(settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, required=True, help="make_random_model.py's folder")
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--n-rollouts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--teacher-top-k", type=int, default=8)
    parser.add_argument("--estimator", default="topk_forward")
    parser.add_argument(
        "--lora-r", type=int, default=0, help="LoRA rank on the attention projections (0: off)"
    )
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--optimizer-offload", action="store_true")
    parser.add_argument("--max-rss-gb", type=float, default=18.0, help="stop the run above this RSS")
    parser.add_argument("--label", default="", help="a name for this run in the table and the JSON")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/learner_memory.json"))
    args = parser.parse_args()
    watchdog(int(args.max_rss_gb * 2**30))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: F401
    import torch  # noqa: F401  (the libraries' own memory belongs to the baseline)

    vocab = json.loads((args.models_dir / "student" / "config.json").read_text())["vocab_size"]
    batch = segments(
        prompts_of(args.models_dir, args.rows // args.n_rollouts),
        args.n_rollouts,
        args.max_new_tokens,
        args.teacher_top_k,
        vocab,
    )
    learner = learner_of(args)
    phases = Phases()
    phases.mark("baseline (libraries imported)")
    instrument(learner, phases)
    learner.initialize()
    module = learner._engine.module
    params = sum(p.numel() for p in module.parameters())
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    learner.train_step([batch])
    phases.mark("step")
    learner.train_step([batch])
    phases.mark("second update (whole)")
    if not args.lora_r:
        weights = learner.named_weights()
        phases.mark("named_weights")
        del weights
        handoffs = learner.export_weights(["shm"])
        phases.mark("export_weights(shm)")
        learner.release_weights(list(handoffs.values()))
    baseline = phases.rows[0]["rss"]
    label = args.label or f"zero{args.zero_stage}"
    print(
        f"{label}: {params / 1e6:.1f} M parameters ({trained / 1e6:.1f} M trained), {len(batch)} rows, "
        f"{sum(len(s.completion_token_ids) for s in batch)} completion tokens, "
        f"baseline {baseline / 2**30:.2f} GiB"
    )
    print(f"{'phase':<32}{'RSS GiB':>9}{'peak GiB':>10}{'RSS B/param':>13}{'peak B/param':>14}")
    for row in phases.rows:
        row["rss_bytes_per_param"] = (row["rss"] - baseline) / params
        row["peak_bytes_per_param"] = (row["peak"] - baseline) / params
        print(
            f"{row['phase']:<32}{row['rss'] / 2**30:>9.2f}{row['peak'] / 2**30:>10.2f}"
            f"{row['rss_bytes_per_param']:>13.1f}{row['peak_bytes_per_param']:>14.1f}"
        )
    peak = max(row["peak"] for row in phases.rows)
    print(f"peak over the run: {(peak - baseline) / params:.1f} bytes per parameter above the baseline")
    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results[f"{args.models_dir.name}/{label}"] = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "parameters": params,
        "trained_parameters": trained,
        "phases": phases.rows,
        "peak_bytes_per_param": (peak - baseline) / params,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
