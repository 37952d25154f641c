"""PostgreSQL restarted while a job trains: a real `opd serve` on a real PostgreSQL (a throwaway server
from Debian's binaries, `postgres_server.py`), a real small job (Ray, vLLM, DeepSpeed on CPU, the tiny
models), and the database stopped for longer than the scheduler lease, then started again on the same
data dir and port.

While it is down the server answers (`/healthz` 200; `/readyz` and requests that need the database fail
at once with a 5xx instead of hanging) and the scheduler waits without marking anything failed; once
it is back the same API key works, the scheduler keeps its lease, the job's driver was never counted
lost, and the job succeeds with every event its driver wrote copied once, in order.

Needs the tiny models (`opd make-tiny-models .cache/tiny-models`) and PostgreSQL's binaries (skipped
without them); 2 to 3 minutes on 2 CPU cores.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from apiserver import ADMIN_KEY, TINY_MODELS_DIR, Server, cancel_unfinished, create_key, wait_for_job
from postgres_server import PostgresUnavailable, _binary, _run_as, throwaway_postgres

from opd_trainer.client import OPDClient

if TYPE_CHECKING:
    from opd_trainer.demo.tiny_models import TinyModels

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

ENGINE = {"kv_cache_memory_bytes": 134217728, "dtype": "float32"}
# Steps take 0.4 s on a quiet 2-core box (24 of them ended inside the outage there) and 1-2 s on a busy
# one: enough of them that the job trains before, during and after the outage either way.
STEPS = 60
LEASE_S = 5  # shorter than the outage: the lease lapses while nobody can renew it
OUTAGE_S = 10


@dataclass
class RestartablePostgres:
    """The throwaway server's data dir and options, to stop it and start it again as it was."""

    url: str
    data: Path
    port: int
    sockets: str

    def _pg_ctl(self, *arguments: str) -> None:
        prefix, _ = _run_as()
        command = [*prefix, _binary("pg_ctl"), "-D", str(self.data), *arguments]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"pg_ctl {arguments[-1]} failed: {done.stderr or done.stdout}"

    def stop(self) -> None:
        """A fast shutdown, as `systemctl restart` or a pod's termination does: every session is ended."""
        self._pg_ctl("-m", "fast", "-w", "stop")

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c max_connections=400"
        )
        log = str(self.data.parent / "server.log")
        self._pg_ctl("-l", log, "-w", "-t", "60", "-o", options, "start")


@pytest.fixture
def postgres() -> Iterator[RestartablePostgres]:
    import psycopg
    from sqlalchemy import make_url

    try:
        with throwaway_postgres() as new_database:
            url = new_database()
            parsed = make_url(url)
            conninfo = (
                f"host={parsed.host} port={parsed.port} user={parsed.username} dbname={parsed.database}"
            )
            with psycopg.connect(conninfo) as connection:
                data, sockets = (
                    str(connection.execute(f"SHOW {name}").fetchall()[0][0])
                    for name in ("data_directory", "unix_socket_directories")
                )
            yield RestartablePostgres(url, Path(data), int(parsed.port or 5432), sockets)
    except PostgresUnavailable as exc:
        pytest.skip(str(exc))


def _job_spec(tiny_models: TinyModels) -> dict[str, Any]:
    """The smallest job of test_api_end_to_end.py: tiny student and teacher, 4 prompts x 2 rollouts."""
    return {
        "job_name": "pg-restart",
        "model": str(tiny_models.student),
        "teacher_model": str(tiny_models.teacher),
        "training_datasets": [str(tiny_models.data_dir / "train.jsonl")],
        "hyper_parameters": {
            "max_steps": STEPS,
            "learning_rate": 1e-3,
            "lr_scheduler_type": "constant",
            "batch_size": 4,
            "n_rollouts": 2,
            "ppo_mini_batch_size": 8,
            "max_length": 1024,
            "max_tokens": 32,
            "save_steps": 100,
            "seed": 0,
        },
        "resources": {"student": ENGINE, "teacher": ENGINE, "learner_gpus": 0},
    }


def _in_order_once(wanted: list[tuple[str, str]], seen: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """What of `wanted` is not found in `seen` in its order (empty: all there)."""
    rest = iter(seen)
    return [item for item in wanted if not any(item == other for other in rest)]


def test_a_postgresql_restart_mid_job_loses_no_job_event_or_key(
    trained_models: TinyModels, tmp_path: Path, postgres: RestartablePostgres
) -> None:
    env = {
        "OPD_MAX_CONCURRENT_JOBS": "1",
        "DATABASE_URL": postgres.url,
        "OPD_SCHEDULER_LEASE_S": str(LEASE_S),
    }
    server = Server(tmp_path / "data", env=env, model_dirs=[TINY_MODELS_DIR, tmp_path])
    server.start(ready_timeout=300, wait_ready=True)
    key = create_key(server.url, "pg-restart")
    client = OPDClient(server.url, key)
    auth = {"Authorization": f"Bearer {key}"}
    job_id = None
    try:
        job_id = client.run(**_job_spec(trained_models))
        wait_for_job(client, job_id, lambda j: j.step >= 2, timeout_s=600)

        postgres.stop()
        stopped_at, outage_started = time.time(), time.monotonic()
        try:
            # The server answers while the database is down, and what needs the database fails at
            # once (no request hangs on a connection that cannot be made).
            assert httpx.get(server.url + "/healthz", timeout=10).status_code == 200
            ready = httpx.get(server.url + "/readyz", timeout=10)
            assert ready.status_code == 503 and ready.json()["checks"]["database"] != "ok", ready.text
            answer = httpx.get(f"{server.url}/v1/opd/jobs/{job_id}", headers=auth, timeout=15)
            assert answer.status_code >= 500, answer.text
            time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - outage_started)))
        finally:
            postgres.start()
            started_at = time.time()

        # The same key, the same job; the database is back for requests and the scheduler alike.
        assert httpx.get(server.url + "/readyz", timeout=10).json()["checks"]["database"] == "ok"
        final = wait_for_job(client, job_id, lambda j: j.status in ("succeeded", "failed", "cancelled"), 600)
        assert final.status == "succeeded", server.log()
        assert final.step == STEPS and final.error is None
        assert [j.id for j in client.iter_jobs()] == [job_id]
        assert create_key(server.url, "after-restart")  # the admin key works against the new connections

        events = client.events(job_id, limit=1000).data
        steps = [e.data["step"] for e in events if e.type == "step"]
        assert steps == list(range(1, STEPS + 1)), json.dumps([e.model_dump(mode="json") for e in events])
        # It trained before the outage, through it and after it (the step events' own times).
        times = [e.time for e in events if e.type == "step"]
        assert times[0] < stopped_at < times[-1] and times[-1] > started_at, (stopped_at, started_at, times)
        assert any(stopped_at < t < started_at for t in times), (stopped_at, started_at, times)
        messages = [e.message for e in events]
        # One driver, never lost nor restarted, and the scheduler moved the job exactly as usual.
        assert sum(m.startswith("queued -> running") for m in messages) == 1
        assert not [e.message for e in events if e.type in ("recovery", "error")]
        assert messages[-1] == "running -> succeeded: driver succeeded"
        # Every event the driver wrote (its events.jsonl) reached the database once, in order.
        run_dir = server.data_dir / "runs" / job_id
        written = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line]
        wanted = [(str(r["type"]), str(r["message"])) for r in written]
        seen = [(e.type, e.message) for e in events]
        assert not _in_order_once(wanted, seen)
        assert all(seen.count(item) == wanted.count(item) for item in set(wanted))
        assert [r["step"] for r in client.metrics(job_id).data if r["kind"] == "train"] == list(
            range(1, STEPS + 1)
        )

        # The scheduler waited the outage out: one warning, no failed steps, and it kept its lease.
        log = server.log_path.read_text(errors="replace") if server.log_path else ""
        assert log.count("database unavailable (") == 1, log[-5000:]
        assert "database reachable again after" in log and "scheduler step failed" not in log
        assert "stepping down" not in log
        ready_checks = httpx.get(server.url + "/readyz", timeout=10).json()["checks"]
        assert ready_checks["scheduler"] == "leader"
        assert httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).is_success
    finally:
        cancel_unfinished(client, job_id)
        server.stop()
