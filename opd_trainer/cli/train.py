"""`opd train JOB.yaml`: runs one job on an embedded local Ray with a live progress bar
(`opd_trainer.driver.local_run`, which `tune(...)` also uses).

Writes per-step metrics (JSONL + TensorBoard), events, checkpoints, PNG curves and a final
teacher / student-before / student-after table under the run directory. Re-running the same
command resumes from the run directory's latest checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path

from opd_trainer.driver.local_run import prepare_spec, train_spec
from opd_trainer.driver.plots import format_final_table
from opd_trainer.errors import OPDError
from opd_trainer.jobspec.job_spec import load_job_spec

__all__ = ["format_final_table", "run_train"]


def run_train(job_file: Path, run_dir: Path | None, stop_after: int | None) -> int:
    """`opd train`: exit code 2 for a job file that fails pre-flight, 1 for a job that fails."""
    try:
        spec = prepare_spec(load_job_spec(job_file))
    except OPDError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        train_spec(spec, run_dir, stop_after)
    except OPDError as exc:
        print(f"error: {exc.field + ': ' if exc.field else ''}{exc.message}", file=sys.stderr)
        return 1
    return 0
