"""`GET /v1/opd/jobs/{id}/validation_trajectories` (api/services/trajectories.py): the recorded validation
rollouts filtered by step, label, model and sample id, paged, with every recorded pass listed,
tenant-scoped. The app in-process on SQLite; the job row and its validation_trajectories.jsonl are
written the way the server and the driver write them (`RunDir.add_validation_trajectories`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from run_dir_app import app_with_job

JOB = "opdjob-validation"
ROUTE = f"/v1/opd/jobs/{JOB}/validation_trajectories"


def _record(step: int, label: str, model: str, sample_id: str, score: float | None) -> dict[str, Any]:
    """A record as `driver.validation.validation_records` writes it (the fields the route reads); a
    student's has a divergence (the teacher scored its tokens), the teacher's none."""
    return {
        "step": step,
        "label": label,
        "model": model,
        "sample_id": sample_id,
        "messages": [{"role": "assistant", "content": f"{label} on {sample_id}"}],
        "llm_calls": [],
        "divergence": None if model == "teacher" else 0.1 * (3 - int(sample_id[1:])),
        "eval_score": score,
        "eval_metrics": {},
    }


PASSES = [(0, "teacher", "teacher"), (0, "student before", "student"), (2, "step 2", "student")]
RECORDS = [_record(s, label, m, f"q{i}", 0.5 * i) for s, label, m in PASSES for i in range(3)]
RECORDS[-1]["eval_score"] = float("nan")


@pytest.fixture
def clients(tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, str], dict[str, str]]]:
    with app_with_job(
        tmp_path, JOB, lambda run: run.add_validation_trajectories(RECORDS), status="running"
    ) as found:
        yield found


def _page(client: TestClient, headers: dict[str, str], **params: Any) -> dict[str, Any]:
    answer = client.get(ROUTE, params=params, headers=headers)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _seen(page: dict[str, Any]) -> list[tuple[str, str]]:
    return [(r["label"], r["sample_id"]) for r in page["data"]]


def test_every_pass_is_listed_and_the_filters_pick_a_pass_or_a_sample(clients) -> None:
    client, owner, _ = clients
    page = _page(client, owner, label="step 2")
    assert page["passes"] == [{"step": s, "label": label, "model": m} for s, label, m in PASSES]
    assert page["steps"] == [0, 2] and page["labels"] == ["teacher", "student before", "step 2"]
    assert _seen(page) == [("step 2", "q0"), ("step 2", "q1"), ("step 2", "q2")]
    assert page["data"][1]["eval_score"] == 0.5 and page["data"][2]["eval_score"] is None  # NaN: null
    assert _seen(_page(client, owner, step=0, model="teacher")) == [("teacher", f"q{i}") for i in range(3)]
    assert _seen(_page(client, owner, sample_id="q1")) == [(label, "q1") for _, label, _ in PASSES]
    assert _page(client, owner, step=5)["data"] == [] and _page(client, owner, step=5)["steps"] == [0, 2]


def test_pages_follow_with_offset_until_has_more_is_false(clients) -> None:
    client, owner, _ = clients
    first = _page(client, owner, limit=5)
    assert len(first["data"]) == 5 and first["has_more"]
    last = _page(client, owner, limit=5, offset=5)
    assert _seen(last) == [("student before", "q2")] + [("step 2", f"q{i}") for i in range(3)]
    assert not last["has_more"]


def test_a_pass_sorts_by_score_or_by_divergence_and_rollouts_without_the_value_come_last(clients) -> None:
    client, owner, _ = clients
    by_score = _page(client, owner, label="step 2", sort="score", order="desc")
    assert _seen(by_score) == [("step 2", "q1"), ("step 2", "q0"), ("step 2", "q2")]  # q2's score is NaN
    assert _seen(_page(client, owner, label="step 2", sort="divergence", order="asc")) == [
        ("step 2", "q2"),
        ("step 2", "q1"),
        ("step 2", "q0"),
    ]
    # Across passes: the students' by divergence, highest first; the teacher's (none) last, as written.
    everything = _seen(_page(client, owner, sort="divergence", order="desc", limit=20))
    assert everything[:2] == [("student before", "q0"), ("step 2", "q0")]
    assert everything[-3:] == [("teacher", f"q{i}") for i in range(3)]
    bad = client.get(ROUTE, params={"sort": "loudest"}, headers=owner)
    assert bad.status_code == 422 and "sort" in bad.json()["error"]["param"]


def test_another_tenant_gets_the_apis_404_and_bad_parameters_a_422_naming_the_field(clients) -> None:
    client, owner, other = clients
    answer = client.get(ROUTE, headers=other)
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "job_id"
    for params, field in (({"model": "critic"}, "model"), ({"step": -1}, "step"), ({"limit": 0}, "limit")):
        bad = client.get(ROUTE, params=params, headers=owner)
        assert bad.status_code == 422 and field in bad.json()["error"]["param"], bad.text
        assert "Traceback" not in bad.text


def test_the_route_documents_its_parameters_and_answer_in_openapi(clients) -> None:
    client, _, _ = clients
    operation = client.get("/openapi.json").json()["paths"]["/v1/opd/jobs/{job_id}/validation_trajectories"][
        "get"
    ]
    params = {p["name"] for p in operation["parameters"]}
    assert {"step", "label", "model", "sample_id", "sort", "order", "limit", "offset"} <= params
    answer = operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert answer.endswith("/ValidationTrajectoryList")
