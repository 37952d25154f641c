"""Two jobs at once on one shared teacher engine (`engine/shared_teachers.py`), real engines and learners.

Job `near` trains a student that *is* the teacher's weights, job `far` the tiny student: on the shared
engine, `near`'s first samples score a reverse KL of zero up to rounding and `far`'s do not, so each
job's tokens were scored as its own, not mixed with the other's. The registry counts the engine
groups it started: one for both jobs, shut down once neither holds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import ray

from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.demo.tiny_models.serving import TINY_KV_CACHE_BYTES
from opd_trainer.driver.job_driver import JobDriver
from opd_trainer.engine.shared_teachers import registry
from opd_trainer.jobspec.job_spec import JobSpec, parse_job_spec
from opd_trainer.jsonl import write_jsonl
from opd_trainer.storage.run_dir import RunDir

pytestmark = pytest.mark.integration


def _job(name: str, student: Path, teacher: Path, data: Path) -> JobSpec:
    engine = {"kv_cache_memory_bytes": TINY_KV_CACHE_BYTES, "dtype": "float32"}
    return parse_job_spec(
        {
            "job_name": name,
            "model": str(student),
            "teacher_model": str(teacher),
            "training_datasets": [str(data)],
            "hyper_parameters": {
                "max_steps": 2,
                "batch_size": 4,
                "n_rollouts": 2,
                "ppo_mini_batch_size": 8,
                "max_length": 512,
                "max_tokens": 24,
                "temperature": 1.0,
                "save_steps": 100,
                "seed": 0,
            },
            "resources": {"student": engine, "teacher": engine, "learner_gpus": 0},
            "report_to": [],
        }
    )


def test_two_jobs_score_on_one_teacher_engine_each_as_its_own(
    ray_session: None, tiny_models: TinyModels, tmp_path: Path
) -> None:
    data = tmp_path / "questions.jsonl"
    write_jsonl(
        data, [{"messages": [{"role": "user", "content": f"Question {i}: name a fruit."}]} for i in range(8)]
    )
    jobs = {
        "near": _job("near", tiny_models.teacher, tiny_models.teacher, data),
        "far": _job("far", tiny_models.student, tiny_models.teacher, data),
    }
    shared = registry(idle_s=0.0)  # created here with no idle time: unheld engines end at once
    drivers = {
        name: ray.remote(JobDriver)
        .options(num_cpus=0)
        .remote(spec, str(tmp_path / name), f"job-{name}", shared_teacher_idle_s=0.0)
        for name, spec in jobs.items()
    }
    try:
        ray.get([driver.run.remote() for driver in drivers.values()])
        state: dict[str, Any] = ray.get(shared.state.remote())
    finally:
        for driver in drivers.values():
            ray.kill(driver)
    try:
        # One engine group served both jobs, and nobody holds it now: it was shut down.
        assert state == {"engine_groups_started": 1, "groups": []}, state
    finally:
        ray.kill(shared)

    records = {name: [r for r in RunDir(tmp_path / name).records() if r["kind"] == "train"] for name in jobs}
    usage = {name: RunDir(tmp_path / name).usage() for name in jobs}
    near_kl, far_kl = records["near"][0]["reverse_kl"], records["far"][0]["reverse_kl"]
    forwarded = {name: sum(r["forwarded_tokens"] for r in rows) for name, rows in records.items()}
    print(
        f"step 1 reverse KL: near {near_kl:.4f}, far {far_kl:.4f}; teacher tokens metered "
        f"{ {n: u['teacher_tokens'] for n, u in usage.items()} }, forwarded {forwarded}"
    )
    assert abs(near_kl) < 0.05 and far_kl > 0.2
    for name in jobs:
        assert [r["step"] for r in records[name]] == [1, 2]
        # Metered per job: its own scoring requests (prompt + completion of what it trained on, a
        # rescored request twice), not the shared engine's total, which holds both jobs'.
        assert forwarded[name] <= usage[name]["teacher_tokens"] < 1.5 * forwarded[name], usage[name]
        assert usage[name]["cpu_s/teacher_engines"] > 0
