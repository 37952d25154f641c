"""`opd train JOB.yaml`: runs one job on an embedded local Ray with a live progress bar
(`opd_trainer.driver.local_run`, which `tune(...)` also uses); `opd estimate JOB.yaml`: what the job
will use, from a short calibration run of it (`opd_trainer.driver.estimate`), after the memory plan of
each role (`opd_trainer.jobspec.memory_plan`); `opd estimate --memory JOB.yaml` prints the plan alone.

Writes per-step metrics (JSONL + TensorBoard), events, checkpoints, PNG curves and a final
teacher / student-before / student-after table under the run directory. Re-running the same
command resumes from the run directory's latest checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from opd_trainer.driver.estimate import estimate, format_estimate
from opd_trainer.driver.local_run import prepare_spec, train_spec
from opd_trainer.driver.plots import format_final_table
from opd_trainer.errors import OPDError
from opd_trainer.jobspec.job_spec import JobSpec, load_job_spec
from opd_trainer.jobspec.memory_plan import format_plan, plan_as_dict, plan_memory, unplannable
from opd_trainer.jobspec.preflight import resolve_max_length

__all__ = ["format_final_table", "run_estimate", "run_train"]


def _prepared(job_file: Path) -> JobSpec | None:
    """The job file, prepared (`prepare_spec`); None after printing why it fails pre-flight."""
    try:
        return prepare_spec(load_job_spec(job_file))
    except OPDError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def _job_failed(exc: OPDError) -> int:
    print(f"error: {exc.field + ': ' if exc.field else ''}{exc.message}", file=sys.stderr)
    return 1


def run_train(job_file: Path, run_dir: Path | None, stop_after: int | None) -> int:
    """`opd train`: exit code 2 for a job file that fails pre-flight, 1 for a job that fails."""
    spec = _prepared(job_file)
    if spec is None:
        return 2
    try:
        train_spec(spec, run_dir, stop_after)
    except OPDError as exc:
        return _job_failed(exc)
    return 0


def run_estimate(job_file: Path, calibration_steps: int, as_json: bool, memory_only: bool = False) -> int:
    """`opd estimate`: the memory plan, then the calibration (`memory_only`: the plan alone, nothing
    started). Exit code 2 for a job file that fails pre-flight or whose plan does not fit (then nothing
    starts), 1 for a calibration that fails."""
    spec = _prepared(job_file)
    if spec is None:
        return 2
    plan = None
    reason = unplannable(spec)
    if reason is not None:
        print(f"no memory plan: {reason}", file=sys.stderr)
        if memory_only:
            return 2
    else:
        try:
            max_length = resolve_max_length(spec.hyper_parameters.max_length, spec.weight_sources())
            plan = plan_memory(spec, max_length)
        except OPDError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if memory_only or not plan.fits:
            print(json.dumps({"memory_plan": plan_as_dict(plan)}, indent=2) if as_json else format_plan(plan))
            return 0 if plan.fits else 2
        if not as_json:
            print(format_plan(plan), flush=True)
    try:
        # The calibration's progress goes to stderr, so that stdout is the estimate alone.
        with contextlib.redirect_stdout(sys.stderr):
            found = estimate(spec, calibration_steps)
    except OPDError as exc:
        return _job_failed(exc)
    if as_json:
        planned = {} if plan is None else {"memory_plan": plan_as_dict(plan)}
        print(json.dumps({**found, **planned}, indent=2))
        return 0
    print(format_estimate(found, spec.job_name))
    return 0
