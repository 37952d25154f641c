"""Health, readiness, Prometheus metrics, and key management with the admin key."""

from __future__ import annotations

import httpx
from apiserver import ADMIN_KEY, Server, Tenant, create_key

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def test_health_and_readiness_need_no_key(server: Server) -> None:
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok", "checks": {}}
    ready = httpx.get(server.url + "/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"database": "ok", "ray": "disabled (max_concurrent_jobs=0)"}


def test_prometheus_metrics_count_jobs_and_time_requests(server: Server, tenant: Tenant) -> None:
    tenant.job()
    text = httpx.get(server.url + "/metrics").text
    queued = next(line for line in text.splitlines() if line.startswith('opd_jobs{status="queued"}'))
    assert float(queued.split()[-1]) >= 1
    assert "opd_queue_depth" in text
    submitted = 'handler="/v1/opd/jobs",method="POST",status="201"'
    assert f"opd_http_request_duration_seconds_count{{{submitted}}}" in text


def test_keys_are_shown_once_listed_per_tenant_and_revocable(server: Server) -> None:
    created = httpx.post(server.url + "/v1/keys", json={"tenant": "acme"}, headers=ADMIN).json()
    assert created["key"].startswith(created["prefix"]) and created["tenant"] == "acme"
    second = create_key(server.url, "acme")
    own = httpx.get(server.url + "/v1/keys", headers={"Authorization": f"Bearer {second}"}).json()["data"]
    assert {k["tenant"] for k in own} == {"acme"} and all(k["key"] is None for k in own)
    every = httpx.get(server.url + "/v1/keys", headers=ADMIN).json()["data"]
    assert created["id"] in {k["id"] for k in every}
    tenant_headers = {"Authorization": f"Bearer {created['key']}"}
    assert httpx.get(server.url + "/v1/files", headers=tenant_headers).status_code == 200
    assert httpx.delete(server.url + f"/v1/keys/{created['id']}", headers=ADMIN).json()["deleted"] is True
    assert httpx.get(server.url + "/v1/files", headers=tenant_headers).status_code == 401
    # Both keys belong to one tenant: what one uploads, the other sees.
    assert (
        httpx.get(server.url + "/v1/files", headers={"Authorization": f"Bearer {second}"}).status_code == 200
    )


def test_keys_are_stored_hashed(server: Server) -> None:
    import sqlite3

    key = create_key(server.url, "hashed")
    with sqlite3.connect(server.data_dir / "opd.db") as db:
        stored = [row[0] for row in db.execute("SELECT key_hash FROM api_keys")]
    assert key not in stored and all(len(h) == 64 for h in stored)
