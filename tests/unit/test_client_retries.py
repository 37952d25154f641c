"""`OPDClient` retries what the server did not act on, and only that (httpx.MockTransport stands in
for the server)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from opd_trainer.client import api_client
from opd_trainer.client.api_client import OPDAPIError, OPDClient

JOB = {"id": "opdjob-1", "status": "queued"}


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(api_client.time, "sleep", slept.append)
    return slept


def client_answering(*answers: int | Exception, retries: int = 4) -> tuple[OPDClient, list[str]]:
    """A client whose server answers each request with the next status (200: JOB) or raises."""
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

    transport: Callable[[httpx.Request], httpx.Response] = handle
    client = OPDClient("http://opd.test", "key", retries=retries, transport=httpx.MockTransport(transport))
    return client, sent


def test_a_read_is_retried_through_unavailability_and_gateway_errors(no_sleep: list[float]) -> None:
    client, sent = client_answering(503, 502, httpx.ReadError("reset"), 504, 200)
    assert client.get_job("opdjob-1") == JOB
    assert sent == ["GET"] * 5 and no_sleep == [0.5, 1.0, 2.0, 4.0]


def test_a_submission_is_retried_only_where_the_server_did_not_act(no_sleep: list[float]) -> None:
    client, sent = client_answering(httpx.ConnectError("refused"), 503, 429, 201)
    assert client.create_job({"job_name": "j"}) == JOB
    assert no_sleep == [0.5, 1.0, 3.0]  # the 429's Retry-After
    for answer in (502, httpx.ReadError("reset")):  # it may have been created: never sent twice
        client, sent = client_answering(answer)
        with pytest.raises((OPDAPIError, httpx.ReadError)):
            client.create_job({"job_name": "j"})
        assert sent == ["POST"]


def test_limits_and_client_errors_are_not_retried() -> None:
    for status in (400, 404, 409):
        client, sent = client_answering(status)
        with pytest.raises(OPDAPIError) as raised:
            client.get_job("opdjob-1")
        assert raised.value.status == status and sent == ["GET"]

    def no_retry_after(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json={"error": {"code": "job_limit_reached", "message": "limit"}})

    client = OPDClient("http://opd.test", "key", transport=httpx.MockTransport(no_retry_after))
    with pytest.raises(OPDAPIError, match="limit"):  # the tenant's job limit: a 429 without Retry-After
        client.create_job({"job_name": "j"})


def test_retries_give_up_with_the_last_answer() -> None:
    client, sent = client_answering(503, 503, 503, retries=2)
    with pytest.raises(OPDAPIError) as raised:
        client.get_job("opdjob-1")
    assert raised.value.status == 503 and len(sent) == 3
