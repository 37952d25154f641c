"""Both clients retry what the server did not act on, and only that (httpx.MockTransport stands in
for the server)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from client_harness import KINDS, client, job_json, record_sleeps

from opd_trainer.client import OPDAPIError
from opd_trainer.wire.schemas import JobPublic

JOB = job_json()


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    return record_sleeps(monkeypatch)


def answering(*answers: int | Exception) -> tuple[Any, list[str]]:
    """A server that answers each request with the next status (2xx: JOB) or raises; what it got."""
    sent: list[str] = []
    queue = list(answers)

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(request.method)
        answer = queue.pop(0)
        if isinstance(answer, Exception):
            raise answer
        body = JOB if answer < 400 else {"error": {"code": "x", "message": f"status {answer}"}}
        headers = {"Retry-After": "3"} if answer == 429 else {}
        return httpx.Response(answer, json=body, headers=headers)

    return handle, sent


@pytest.mark.parametrize("kind", KINDS)
def test_a_read_is_retried_through_unavailability_and_gateway_errors(kind: str, slept: list[float]) -> None:
    handle, sent = answering(503, 502, httpx.ReadError("reset"), 504, 200)
    with client(kind, handle, retries=4) as opd:
        assert opd.get_job("opdjob-1") == JobPublic.model_validate(JOB)
    assert sent == ["GET"] * 5 and slept == [0.5, 1.0, 2.0, 4.0]


@pytest.mark.parametrize("kind", KINDS)
def test_a_submission_is_retried_only_where_the_server_did_not_act(kind: str, slept: list[float]) -> None:
    handle, sent = answering(httpx.ConnectError("refused"), 503, 429, 201)
    with client(kind, handle, retries=4) as opd:
        assert opd.create_job({"job_name": "j"}).id == JOB["id"]
    assert slept == [0.5, 1.0, 3.0]  # the 429's Retry-After
    for answer in (502, httpx.ReadError("reset")):  # it may have been created: never sent twice
        handle, sent = answering(answer)
        with client(kind, handle, retries=4) as opd, pytest.raises((OPDAPIError, httpx.ReadError)):
            opd.create_job({"job_name": "j"})
        assert sent == ["POST"]


@pytest.mark.parametrize("kind", KINDS)
def test_limits_and_client_errors_are_not_retried(kind: str) -> None:
    for status in (400, 404, 409):
        handle, sent = answering(status)
        with client(kind, handle) as opd, pytest.raises(OPDAPIError) as raised:
            opd.get_job("opdjob-1")
        assert raised.value.status == status and sent == ["GET"]

    def no_retry_after(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json={"error": {"code": "job_limit_reached", "message": "limit"}})

    # The tenant's job limit: a 429 without Retry-After.
    with client(kind, no_retry_after) as opd, pytest.raises(OPDAPIError, match="limit"):
        opd.create_job({"job_name": "j"})


@pytest.mark.parametrize("kind", KINDS)
def test_retries_give_up_with_the_last_answer(kind: str, slept: list[float]) -> None:
    handle, sent = answering(503, 503, 503)
    with client(kind, handle, retries=2) as opd, pytest.raises(OPDAPIError) as raised:
        opd.get_job("opdjob-1")
    assert raised.value.status == 503 and len(sent) == 3
    handle, sent = answering(*[httpx.ConnectError("refused")] * 3)
    with client(kind, handle, retries=2) as opd, pytest.raises(httpx.ConnectError):
        opd.get_job("opdjob-1")
    assert len(sent) == 3
