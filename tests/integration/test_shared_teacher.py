"""Two jobs at once on one shared teacher engine (`engine/shared_engines.py`), real engines and learners.

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
from opd_trainer.engine.engine_sharing import EngineSharing
from opd_trainer.engine.fleet import EngineFleet, shared_registry
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
    sharing = EngineSharing(idle_s=0.0)  # no idle time: unheld engines end at once
    shared = shared_registry(sharing, "teacher")  # created here, with these settings
    drivers = {
        name: ray.remote(JobDriver)
        .options(num_cpus=0)
        .remote(spec, str(tmp_path / name), f"job-{name}", teacher_sharing=sharing)
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
        assert (state["engine_groups_started"], state["groups"]) == (1, []), state
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


def test_a_shared_group_grows_under_load_and_shrinks_when_idle(
    ray_session: None, tiny_models: TinyModels, tokenizer: Any
) -> None:
    """Requests waiting for a slot on the one replica (2 slots) make the registry add a second (up to
    `max_replicas` 2); the job's group then sends to both; idle, the added replica is given back."""
    import asyncio
    import time

    from opd_trainer.demo.tiny_models.serving import tiny_engine_config

    config = tiny_engine_config(tiny_models.teacher).model_copy(
        update={"role": "teacher", "concurrent_sequences": 2}
    )
    sharing = EngineSharing(idle_s=0.0, max_replicas=2, check_s=0.5)
    shared = shared_registry(sharing, "teacher")
    prompt = tokenizer("Name three colours and three fruits, please.")["input_ids"]
    pairs = [(prompt, [(7 * i + j) % 200 + 10 for j in range(24)]) for i in range(64)]

    def replicas() -> int:
        [group] = ray.get(shared.state.remote())["groups"] or [{"replicas": 0}]
        return int(group["replicas"])

    async def go() -> tuple[int, float]:
        fleet = EngineFleet("job-load")
        group = await fleet.acquire(config, sharing, "teacher")
        deadline = time.monotonic() + 240
        while replicas() < 2:  # keep requests waiting until the second replica is up
            assert time.monotonic() < deadline, ray.get(shared.state.remote())
            await group.score_many(pairs)
        await asyncio.sleep(1.5)  # past REFRESH_S: the group reads the new replica list
        await group.score_many(pairs)
        sent_to = len(group.actors)
        while replicas() > 1:  # nothing sent now: the added replica is given back
            assert time.monotonic() < deadline, ray.get(shared.state.remote())
            await asyncio.sleep(0.5)
        usage = await group.usage()
        await fleet.stop()
        return sent_to, usage["prompt_tokens"]

    try:
        sent_to, metered = asyncio.run(go())
        state = ray.get(shared.state.remote())
    finally:
        ray.kill(shared)
    assert sent_to == 2
    assert (state["replicas_added"], state["replicas_removed"], state["groups"]) == (1, 1, []), state
    # Every request was metered to the job, on whichever replica it ran (the removed one's too).
    assert metered > 0 and metered % (len(prompt) + 24) == 0
