"""Jobs over real HTTP with the scheduler off: submission, listing, transitions, events (JSON and SSE)."""

from __future__ import annotations

import threading

import pytest
from apiserver import Tenant, jsonl, record

from opd_trainer.client import StreamEnd
from opd_trainer.wire.schemas import EventPublic


def test_submitted_job_is_queued_with_its_spec_and_step_count(tenant: Tenant) -> None:
    dataset = tenant.upload(jsonl([record(str(i)) for i in range(5)]))
    spec = tenant.spec(dataset["id"], hyper_parameters={"batch_size": 2, "n_epochs": 2})
    job = tenant.http.post("/v1/opd/jobs", json=spec).json()
    assert job["status"] == "queued" and job["object"] == "opd.job"
    assert job["total_steps"] == 6  # 2 epochs × ceil(5 / 2)
    assert job["spec"]["training_datasets"] == [dataset["id"]]
    assert job["spec"]["hyper_parameters"]["n_epochs"] == 2
    assert tenant.http.get(f"/v1/opd/jobs/{job['id']}").json() == job
    events = tenant.http.get(f"/v1/opd/jobs/{job['id']}/events").json()
    assert [e["data"]["status"] for e in events["data"]] == ["validating_files", "queued"]


def test_workspace_job_resolves_the_file_id(tenant: Tenant, workspace_zip: bytes) -> None:
    workspace = tenant.upload(workspace_zip, "workspace", "ws.zip")
    component = {
        "name": "score",
        "type": "reward",
        "fcmodel": {"workspace": workspace["id"], "classpath": "functions.reward.MyReward"},
    }
    job = tenant.job(functions=[component])
    assert job["spec"]["functions"][0]["fcmodel"] == {
        "workspace": workspace["id"],
        "classpath": "functions.reward.MyReward",
    }


def test_listing_pages_newest_first_and_filters_by_status(tenant: Tenant) -> None:
    ids = [tenant.job(job_name=f"job-{i}")["id"] for i in range(3)]
    tenant.http.post(f"/v1/opd/jobs/{ids[0]}/cancel")
    first = tenant.http.get("/v1/opd/jobs", params={"limit": 2}).json()
    assert [j["id"] for j in first["data"]] == [ids[2], ids[1]] and first["has_more"]
    rest = tenant.http.get("/v1/opd/jobs", params={"limit": 2, "after": ids[1]}).json()
    assert [j["id"] for j in rest["data"]] == [ids[0]] and not rest["has_more"]
    cancelled = tenant.http.get("/v1/opd/jobs", params={"status": "cancelled"}).json()["data"]
    assert [j["id"] for j in cancelled] == [ids[0]]


@pytest.mark.parametrize(
    ("actions", "statuses"),
    [
        (["pause", "resume", "cancel"], ["paused", "queued", "cancelled"]),
        (["cancel"], ["cancelled"]),
        (["pause", "cancel"], ["paused", "cancelled"]),
    ],
)
def test_user_transitions(tenant: Tenant, actions: list[str], statuses: list[str]) -> None:
    job = tenant.job()
    for action, status in zip(actions, statuses, strict=True):
        response = tenant.http.post(f"/v1/opd/jobs/{job['id']}/{action}")
        assert response.status_code == 200, response.text
        assert response.json()["status"] == status
    assert tenant.http.get(f"/v1/opd/jobs/{job['id']}").json()["finished_at"] is not None
    assert tenant.http.delete(f"/v1/opd/jobs/{job['id']}").json()["deleted"] is True
    assert tenant.http.get(f"/v1/opd/jobs/{job['id']}").status_code == 404


def test_events_cursor_logs_and_empty_run_records(tenant: Tenant) -> None:
    job = tenant.job()
    tenant.http.post(f"/v1/opd/jobs/{job['id']}/pause")
    page = tenant.http.get(f"/v1/opd/jobs/{job['id']}/events", params={"limit": 2}).json()
    assert page["has_more"] and len(page["data"]) == 2
    rest = tenant.http.get(
        f"/v1/opd/jobs/{job['id']}/events", params={"after": page["data"][-1]["id"]}
    ).json()
    assert [e["message"] for e in rest["data"]] == ["pause requested: queued -> paused"]
    logs = tenant.http.get(f"/v1/opd/jobs/{job['id']}/logs")
    assert logs.headers["content-type"].startswith("text/plain")
    assert logs.text.splitlines()[-1].endswith("[status] pause requested: queued -> paused")
    assert tenant.http.get(f"/v1/opd/jobs/{job['id']}/checkpoints").json()["data"] == []
    assert tenant.http.get(f"/v1/opd/jobs/{job['id']}/metrics").json() == {
        "object": "opd.job.metrics",
        "data": [],
        "summary": {},
    }
    assert tenant.http.get(f"/v1/opd/jobs/{job['id']}/trajectories").json()["data"] == []


def test_event_stream_follows_until_the_job_ends(tenant: Tenant) -> None:
    job = tenant.job()
    received: list[EventPublic | StreamEnd] = []
    follower = threading.Thread(target=lambda: received.extend(tenant.client.stream_events(job["id"])))
    follower.start()
    tenant.http.post(f"/v1/opd/jobs/{job['id']}/pause")
    tenant.http.post(f"/v1/opd/jobs/{job['id']}/cancel")
    follower.join(timeout=30)
    assert not follower.is_alive()
    *events, end = received
    assert [e.type for e in events] == ["status"] * 4 and isinstance(end, StreamEnd)
    assert end.job is not None and end.job.status == "cancelled"
    ids = [e.id for e in events if isinstance(e, EventPublic)]
    assert ids == sorted(ids)


def test_tenant_active_job_limit(tenant: Tenant) -> None:
    jobs = [tenant.job() for _ in range(4)]  # the shared server allows 4
    refused = tenant.http.post("/v1/opd/jobs", json=tenant.spec(jobs[0]["spec"]["training_datasets"][0]))
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "job_limit_reached"
    tenant.http.post(f"/v1/opd/jobs/{jobs[0]['id']}/cancel")
    assert tenant.http.post(
        "/v1/opd/jobs", json=tenant.spec(jobs[0]["spec"]["training_datasets"][0])
    ).is_success
