"""What a job will use, before it runs: `opd estimate JOB_FILE`.

A short calibration run of the job itself (its engines, learner, processors and data; the first
`calibration_steps` steps, validating after the first) is metered like any job (`driver/metering.py`),
and its records say what each part of a job costs: the start (start-up, drift probe, the teacher's
baseline and the starting student's validation: the first validation record), the first training step
(it warms caches and allocators: counted once), a steady step (the mean of the later training records)
and one validation of the trained student (the validation after step 1). The estimate is

    start + first step + (total_steps - 1) x steady step + validations x validation

for every metered key, `validations` being the job's validations every `eval_steps` and the final one.
What varies with what the student learns (completion lengths, a processor's speed) is taken at the
start of training; `docs/benchmarks.md` reports how far the estimate fell from real runs.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from opd_trainer.driver.metering import RECORDED
from opd_trainer.jobspec.dataset import load_samples
from opd_trainer.jobspec.job_spec import Budget, JobSpec
from opd_trainer.stats import mean

DEFAULT_CALIBRATION_STEPS = 2
# What an estimate's table shows (`opd estimate`, `opd submit --dry-run --follow`), in this order.
ESTIMATE_ROWS = (
    ("teacher tokens", "teacher_tokens", ""),
    ("  of them from the prefix cache", "teacher_cached_tokens", ""),
    ("student tokens generated", "student_generated_tokens", ""),
    ("student prompt tokens", "student_prompt_tokens", ""),
    ("learner tokens trained", "learner_tokens_trained", ""),
    ("processor calls", "processor_calls", ""),
    ("CPU-seconds", "cpu_s", " s"),
    ("GPU-seconds", "gpu_s", " s"),
    ("wall time", "wall_s", " s"),
)


def calibration_spec(spec: JobSpec, steps: int, *, ends_by_itself: bool = False) -> JobSpec:
    """The job as it calibrates: validating after its first step, checkpointing only at the stop, no
    trackers and no budget (the calibration is short by itself). `ends_by_itself`: `max_steps` is
    `steps` (a dry run on the job server, whose drivers run to the end; `opd estimate` stops its own
    after `steps` and keeps the job's learning-rate schedule)."""
    update: dict[str, Any] = {"eval_steps": 1, "save_steps": max(steps, 1) + 1}
    if ends_by_itself:
        update["max_steps"] = steps
    hp = spec.hyper_parameters.model_copy(update=update)
    return spec.model_copy(
        update={
            "job_name": f"{spec.job_name}-calibration",
            "hyper_parameters": hp,
            "report_to": [],
            "budget": Budget(),  # no limit
        }
    )


def validations(spec: JobSpec, total_steps: int) -> int:
    """Validations of the trained student a full run makes: every `eval_steps` before the last step,
    and the final one."""
    if not spec.validation_datasets:
        return 0
    every = spec.hyper_parameters.eval_steps
    return sum(1 for step in range(1, total_steps) if step % every == 0) + 1


def _usage(record: dict[str, Any]) -> dict[str, float]:
    return {key: float(record.get(f"usage/{key}", 0.0)) for key in RECORDED}


def estimate_from_records(records: list[dict[str, Any]], spec: JobSpec, total_steps: int) -> dict[str, Any]:
    """The estimate (see the module docstring) from a calibration run's records: `usage` per metered
    key, with the parts it was made of."""
    train = [_usage(r) for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    if not train:
        raise ValueError("the calibration run recorded no training step")
    start = _usage(evals[0]) if evals and evals[0]["step"] == 0 else dict.fromkeys(RECORDED, 0.0)
    trained_evals = [_usage(r) for r in evals if r["step"] >= 1]
    first, steady_steps = train[0], train[1:] or train[:1]
    step = {key: mean([u[key] for u in steady_steps]) for key in RECORDED}
    validation = trained_evals[0] if trained_evals else dict.fromkeys(RECORDED, 0.0)
    count = validations(spec, total_steps)
    usage = {
        key: start[key] + first[key] + (total_steps - 1) * step[key] + count * validation[key]
        for key in RECORDED
    }
    return {
        "total_steps": total_steps,
        "validations": count,
        "calibration_steps": len(train),
        "usage": usage,
        "start": start,
        "first_step": first,
        "step": step,
        "validation": validation,
    }


def steps_to_calibrate(total_steps: int, asked: int = DEFAULT_CALIBRATION_STEPS) -> int:
    """Steps a calibration runs: `asked`, at least 1 and at most the job's own."""
    return max(1, min(asked, total_steps))


def format_estimate(found: dict[str, Any], job_name: str) -> str:
    """An estimate (`estimate_from_records`) as the lines `opd estimate` prints."""
    lines = [
        f"estimate for {job_name}: {found['total_steps']} steps, {found['validations']} validations "
        f"(from {found['calibration_steps']} calibration steps)"
    ]
    lines += [f"  {label:<32} {found['usage'][key]:>14,.0f}{unit}" for label, key, unit in ESTIMATE_ROWS]
    return "\n".join(lines)


def estimate(spec: JobSpec, calibration_steps: int = DEFAULT_CALIBRATION_STEPS) -> dict[str, Any]:
    """Runs the calibration (on the local or `RAY_ADDRESS` Ray, like `opd train`) and estimates the job."""
    # Lazy: the calibration run loads Ray and the driver's stack only when an estimate is asked for.
    from opd_trainer.driver.local_run import train_spec
    from opd_trainer.storage.run_dir import RunDir

    total_steps = spec.hyper_parameters.total_steps(
        len(load_samples(spec.training_datasets, "training_datasets"))
    )
    steps = steps_to_calibrate(total_steps, calibration_steps)
    with tempfile.TemporaryDirectory(prefix="opd-estimate-") as scratch:
        run_dir = Path(scratch) / "run"
        train_spec(calibration_spec(spec, steps), run_dir, stop_after=steps)
        return estimate_from_records(RunDir(run_dir).records(), spec, total_steps)
