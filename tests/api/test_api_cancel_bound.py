"""Cancel within a bound and a fair queue, on a real `opd serve` with its embedded Ray and real job drivers.

Every job here is stuck the way a job waiting for hardware is: its engines and learner ask for a Ray
resource no node has, with an hour's `placement_timeout_s`, so the driver sits in its set-up and never
reaches the end of a step, where it would look at a stop request. With two slots, one per tenant:

1. tenant A's two jobs, then tenant B's one: A's first and B's run, A's second waits (oldest-first
   would have run both of A's and kept B waiting behind A's stuck job);
2. A's first job is cancelled: the driver does not stop, so the scheduler kills it after
   `OPD_CANCEL_GRACE_S`, and the job is `cancelled` within that bound plus a poll; A's second starts;
3. the others are cancelled too (A's second while its driver may still be starting) and, once all
   are `cancelled`, no driver, gateway or other actor process of theirs is left under the server.

Needs only Ray (a tokenizer folder stands in for the models: nothing gets as far as loading one).
About two minutes on 2 CPU cores.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from apiserver import Server, create_key, jsonl, make_tokenizer, record

from opd_trainer.client import OPDClient
from opd_trainer.wire.schemas import JobPublic

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

GRACE_S = 10.0
# What the server adds to the bound: a poll interval (0.5 s here), the wait for drivers' answers, and
# a scheduler tick on 2 busy cores.
SLACK_S = 8.0
ABSENT = {"opd-test-no-such-node": 1}
# The job's own actors, by Ray's process title (ray::<class>.<method>, ray::<class> between calls).
JOB_ACTORS = ("JobDriver", "Gateway", "Engine", "Learner", "ProcessorWorker")


def stuck_job(model: str, dataset: str, name: str) -> dict[str, Any]:
    engines = {"ray_resources": ABSENT, "kv_cache_memory_bytes": 134217728}
    return {
        "job_name": name,
        "model": model,
        "teacher_model": model,
        "training_datasets": [dataset],
        "hyper_parameters": {"max_steps": 1, "batch_size": 2},
        "resources": {
            "student": engines,
            "teacher": engines,
            "learner_gpus": 0,
            "learner_ray_resources": ABSENT,
            "placement_timeout_s": 3600,
        },
    }


def wait_for(what: str, check: Any, timeout_s: float, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(every_s)
    raise AssertionError(f"not {what} after {timeout_s}s")


def job_actor_processes(server: Server) -> list[str]:
    assert server.process is not None
    titles = []
    for process in psutil.Process(server.process.pid).children(recursive=True):
        try:
            title = " ".join(process.cmdline())
        except psutil.Error:
            continue
        if title.startswith("ray::") and any(name in title for name in JOB_ACTORS):
            titles.append(title)
    return titles


def cancel_and_time(client: OPDClient, job_id: str) -> tuple[JobPublic, float]:
    """Cancels the job; returns it once `cancelled` and the seconds that took."""
    asked = time.monotonic()
    assert client.cancel_job(job_id).status == "cancelling"
    job = wait_for(
        f"{job_id} cancelled",
        lambda: (j := client.get_job(job_id)).status == "cancelled" and j,
        GRACE_S + 60,
        every_s=0.25,
    )
    return job, time.monotonic() - asked


def forced(client: OPDClient, job_id: str) -> bool:
    events = client.events(job_id, limit=1000).data
    return any(e.data.get("status") == "cancelled" and e.data.get("forced") for e in events)


def test_stuck_jobs_are_cancelled_within_the_bound_and_never_block_another_tenant(tmp_path: Path) -> None:
    model = str(make_tokenizer(tmp_path / "model"))
    (tmp_path / "train.jsonl").write_bytes(jsonl([record("hello world")] * 4))
    dataset = str(tmp_path / "train.jsonl")
    env = {
        "OPD_MAX_CONCURRENT_JOBS": "2",
        "OPD_MAX_CONCURRENT_JOBS_PER_TENANT": "1",
        "OPD_CANCEL_GRACE_S": str(GRACE_S),
    }
    server = Server(tmp_path / "data", env=env, model_dirs=[tmp_path]).start(
        ready_timeout=300, wait_ready=True
    )
    try:
        a = OPDClient(server.url, create_key(server.url, "tenant-a"))
        b = OPDClient(server.url, create_key(server.url, "tenant-b"))
        a1 = a.run(**stuck_job(model, dataset, "a1"))
        a2 = a.run(**stuck_job(model, dataset, "a2"))
        b1 = b.run(**stuck_job(model, dataset, "b1"))

        # 1. One slot per tenant: B's job runs beside A's first; A's second waits.
        wait_for("a1 and b1 running", lambda: a.get_job(a1).status == b.get_job(b1).status == "running", 60)
        time.sleep(2)  # a few more polls: nothing else starts
        assert a.get_job(a2).status == "queued"

        # 2. A's first job, stuck in its set-up, is cancelled by force within the bound.
        wait_for(
            "a1's driver set up its components",
            lambda: any(e.message == "starting engines and learner" for e in a.events(a1, limit=1000).data),
            300,
        )
        # What the check after the cancels looks for is there to be found: the driver's process (its
        # engines and learner cannot be placed, and the gateways live in the teacher engine's process).
        wait_for(
            "a driver's process",
            lambda: any("JobDriver" in t for t in job_actor_processes(server)),
            120,
        )
        job, took = cancel_and_time(a, a1)
        assert GRACE_S - 1 <= took <= GRACE_S + SLACK_S, (took, server.log())
        assert forced(a, a1) and job.finished_at is not None
        wait_for("a2 running in a1's slot", lambda: a.get_job(a2).status == "running", 30)

        # 3. The rest, A's second while its driver may still be starting; then nothing of theirs is left.
        for client, job_id in ((a, a2), (b, b1)):
            job, took = cancel_and_time(client, job_id)
            assert took <= GRACE_S + SLACK_S, (job_id, took, server.log())
            assert job.status == "cancelled"
        deadline = time.monotonic() + 60
        while left := job_actor_processes(server):
            assert time.monotonic() < deadline, left
            time.sleep(1)
        assert server_checks(server)["scheduler"] == "leader"
    finally:
        server.stop()


def server_checks(server: Server) -> dict[str, str]:
    import httpx

    return httpx.get(server.url + "/readyz").json()["checks"]
