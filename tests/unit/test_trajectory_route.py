"""`GET /v1/opd/jobs/{id}/trajectories` (api/services/trajectories.py): a step's rollouts sorted by reward
or divergence, paged by offset, the steps listed, tenant-scoped; the default stays the latest written.
The app in-process on SQLite; the job row and its trajectories.jsonl are written the way the server
and the driver write them (`RunDir.trajectories`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from run_dir_app import app_with_job

JOB = "opdjob-trajectories"


def _trajectory(step: int, name: str, reward: float, divergence: float | None, failed: bool = False) -> dict:
    """A record as `RolloutResult.trajectory` writes it (the fields the route reads)."""
    return {
        "step": step,
        "rollout_id": name,
        "failed": failed,
        "messages": [],
        "llm_calls": [],
        "divergence": divergence,
        "reward": reward,
    }


RECORDS = [
    _trajectory(1, "a", 0.1, 0.3),
    _trajectory(1, "b", 0.9, -0.2),
    _trajectory(2, "c", 0.5, 0.05),
    _trajectory(2, "d", 0.0, None, failed=True),
    _trajectory(2, "e", 1.0, 0.7),
    _trajectory(2, "f", 0.2, -0.4),
    _trajectory(3, "g", 0.3, float("nan")),
]


@pytest.fixture
def clients(tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, str], dict[str, str]]]:
    with app_with_job(tmp_path, JOB, lambda run: run.trajectories(RECORDS), status="succeeded") as found:
        yield found


def _page(client: TestClient, headers: dict[str, str], **params: Any) -> dict[str, Any]:
    answer = client.get(f"/v1/opd/jobs/{JOB}/trajectories", params=params, headers=headers)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _names(page: dict[str, Any]) -> list[str]:
    return [t["rollout_id"] for t in page["data"]]


def test_a_steps_rollouts_sorted_by_reward_or_divergence_either_way_with_the_valueless_last(clients) -> None:
    client, owner, _ = clients
    assert _names(_page(client, owner, step=2, sort="reward")) == ["e", "c", "f", "d"]  # d failed: no reward
    assert _names(_page(client, owner, step=2, sort="reward", order="asc")) == ["f", "c", "e", "d"]
    assert _names(_page(client, owner, step=2, sort="divergence")) == ["e", "c", "f", "d"]
    assert _names(_page(client, owner, step=2, sort="divergence", order="asc")) == ["f", "c", "e", "d"]
    assert _names(_page(client, owner, step=2, sort="recent")) == ["f", "e", "d", "c"]
    assert _names(_page(client, owner, sort="divergence")) == ["e", "a", "c", "b", "f", "d", "g"]
    nan = _page(client, owner, step=3)
    assert nan["data"][0]["divergence"] is None and nan["steps"] == [1, 2, 3]  # NaN reads as null


def test_pages_follow_with_offset_until_has_more_is_false(clients) -> None:
    client, owner, _ = clients
    first = _page(client, owner, step=2, sort="reward", limit=3)
    assert _names(first) == ["e", "c", "f"] and first["has_more"]
    last = _page(client, owner, step=2, sort="reward", limit=3, offset=3)
    assert _names(last) == ["d"] and not last["has_more"]
    assert _page(client, owner, step=9)["data"] == []


def test_without_step_or_sort_the_latest_are_given_in_the_order_written(clients) -> None:
    client, owner, _ = clients
    latest = _page(client, owner, limit=3)
    assert _names(latest) == ["e", "f", "g"] and latest["has_more"]
    before = _page(client, owner, limit=3, offset=3)
    assert _names(before) == ["b", "c", "d"] and before["has_more"]
    assert _names(_page(client, owner, limit=3, offset=6)) == ["a"]
    assert not _page(client, owner, limit=3, offset=6)["has_more"]


def test_another_tenant_gets_the_apis_404_and_bad_parameters_a_422(clients) -> None:
    client, owner, other = clients
    answer = client.get(f"/v1/opd/jobs/{JOB}/trajectories", params={"step": 2}, headers=other)
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "job_id"
    for params in ({"sort": "loss"}, {"order": "up"}, {"offset": -1}, {"step": -1}):
        bad = client.get(f"/v1/opd/jobs/{JOB}/trajectories", params=params, headers=owner)
        assert bad.status_code == 422, params


def test_the_route_documents_its_parameters_in_openapi(clients) -> None:
    client, _, _ = clients
    operation = client.get("/openapi.json").json()["paths"]["/v1/opd/jobs/{job_id}/trajectories"]["get"]
    params = {p["name"]: p for p in operation["parameters"]}
    assert {"step", "sort", "order", "limit", "offset"} <= params.keys()
    assert "divergence" in str(params["sort"]["schema"])
