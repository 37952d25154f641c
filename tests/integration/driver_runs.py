"""A job run by its `JobDriver` as a Ray actor in the test's Ray session, the way the job server runs it,
without the server: what most integration tests of a whole job do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray

from opd_trainer.driver.job_driver import JobDriver


def run_driver(spec: Any, run_dir: Path, stop_after: int | None = None, timeout: float | None = None) -> Any:
    """Runs `spec` to its end (or `stop_after` steps) in `run_dir`; returns the driver's summary. The
    driver actor is killed afterwards, and with it every engine, learner and pool it owns."""
    driver = ray.remote(JobDriver).options(num_cpus=0).remote(spec, str(run_dir))
    try:
        return ray.get(driver.run.remote(stop_after), timeout=timeout)
    finally:
        ray.kill(driver)
