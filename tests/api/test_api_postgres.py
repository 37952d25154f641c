"""The job server on PostgreSQL (a throwaway server from Debian's binaries, see `postgres_server.py`,
or `OPD_TEST_DATABASE_URL`): a file upload, a job's lifecycle and its events."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
from apiserver import Server, create_key, jsonl, record


def test_job_lifecycle_on_postgresql(
    tmp_path: Path, models: dict[str, str], postgres_databases: Callable[[], str]
) -> None:
    server = Server(
        tmp_path / "data",
        env={"OPD_MAX_CONCURRENT_JOBS": "0", "DATABASE_URL": postgres_databases()},
        model_dirs=[Path(models["student"]).parent],
    )
    server.start()
    try:
        key = create_key(server.url, f"pg-{uuid.uuid4().hex[:8]}")
        http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        dataset = http.post(
            "/v1/files", files={"file": ("d.jsonl", jsonl([record()]))}, data={"purpose": "dataset"}
        ).json()
        spec = {
            "job_name": "pg",
            "model": models["student"],
            "teacher_model": models["teacher"],
            "training_datasets": [dataset["id"]],
        }
        job = http.post("/v1/opd/jobs", json=spec).json()
        assert job["status"] == "queued"
        assert http.post(f"/v1/opd/jobs/{job['id']}/pause").json()["status"] == "paused"
        assert http.post(f"/v1/opd/jobs/{job['id']}/resume").status_code == 200
        assert http.post(f"/v1/opd/jobs/{job['id']}/resume").status_code == 409
        assert http.post(f"/v1/opd/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
        events = http.get(f"/v1/opd/jobs/{job['id']}/events").json()["data"]
        assert [e["data"]["status"] for e in events][-1] == "cancelled"
        assert http.get("/readyz").json()["checks"]["database"] == "ok"
    finally:
        server.stop()
