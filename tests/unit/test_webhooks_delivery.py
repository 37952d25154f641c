"""The webhook outbox and deliverer on a real SQLite file, with httpx's mock transport as the receiver:
deliveries written with the status change, retries, order per job, pinning to the checked address,
DNS rebinding, redirects, running out of attempts."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from api.db import Database, migrate
from api.models import Job, Tenant, WebhookAttempt, WebhookDelivery, WebhookEndpoint
from api.services.jobs import compare_and_set
from api.services.webhooks_delivery import Deliverer
from api.settings import Settings
from opd_trainer.client.webhooks import new_secret, verify_webhook

JOB = "opdjob-0123"
FAST = {
    "webhook_backoff_base_s": 0.05,
    "webhook_backoff_cap_s": 0.1,
    "webhook_poll_interval_s": 0.05,
    "webhook_timeout_s": 5.0,
}


@pytest.fixture
def db(tmp_path: Path) -> Database:
    database = Database(f"sqlite:///{tmp_path / 'opd.db'}")
    migrate(database.engine)
    with database.session() as session:
        session.add(Tenant(id="tenant-1", name="acme"))
        session.flush()
        session.add(
            Job(
                id=JOB,
                tenant_id="tenant-1",
                job_name="demo",
                status="queued",
                spec={},
                run_dir=str(tmp_path / "runs" / JOB),
            )
        )
        session.commit()
    return database


def _endpoint(db: Database, url: str, events: list[str] | None = None) -> str:
    secret = new_secret()
    with db.session() as session:
        session.add(
            WebhookEndpoint(
                id=f"whk-{len(url)}-{secret[-6:]}",
                tenant_id="tenant-1",
                url=url,
                events=events
                or ["job.running", "job.paused", "job.succeeded", "job.failed", "job.cancelled"],
                secret=secret,
            )
        )
        session.commit()
    return secret


def _move(db: Database, *moves: tuple[str, str], **fields: Any) -> None:
    with db.session() as session:
        for old, new in moves:
            assert compare_and_set(session, JOB, old, new, **fields)
            session.commit()


def _deliveries(db: Database) -> list[WebhookDelivery]:
    with db.session() as session:
        return list(session.scalars(select(WebhookDelivery).order_by(WebhookDelivery.seq)))


def _attempts(db: Database) -> list[tuple[int, int, int | None]]:
    with db.session() as session:
        rows = session.scalars(select(WebhookAttempt).order_by(WebhookAttempt.id))
        return [(a.delivery_seq, a.number, a.status_code) for a in rows]


@pytest.fixture
def resolve_to(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Makes every name resolve to one address on the event loop (the deliverer's resolver)."""

    def set_address(address: str) -> None:
        async def getaddrinfo(_loop: Any, host: str, port: int, **_kw: Any) -> list[Any]:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

        monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", getaddrinfo)

    return set_address


def _deliver(
    db: Database,
    handler: Callable[[httpx.Request], httpx.Response],
    done: Callable[[], bool],
    **settings: Any,
) -> None:
    async def run() -> None:
        deliverer = Deliverer(Settings(**{**FAST, **settings}), db, transport=httpx.MockTransport(handler))
        deliverer.start()
        try:
            for _ in range(200):
                await asyncio.sleep(0.05)
                if done():
                    return
            raise AssertionError("deliveries did not finish")
        finally:
            await deliverer.stop()

    asyncio.run(run())


def test_a_status_change_writes_its_deliveries_in_its_own_transaction(db: Database, tmp_path: Path) -> None:
    _endpoint(db, "https://a.example.com/", ["job.failed"])
    _endpoint(db, "https://b.example.com/")
    with db.session() as session:
        assert compare_and_set(session, JOB, "queued", "running")
        session.rollback()  # the move is undone: so are its deliveries
    assert _deliveries(db) == []
    path = f"{tmp_path}/runs/{JOB}/checkpoints"
    error = {"code": "job_failed", "message": f"disk full under {path}", "param": None}
    _move(db, ("queued", "running"), ("running", "pausing"))
    _move(db, ("pausing", "failed"), error=error)
    rows = _deliveries(db)
    # b wants both events; a only job.failed; pausing sends none.
    assert [(r.endpoint_id[:5], r.event_type) for r in rows] == [
        ("whk-2", "job.running"),
        ("whk-2", "job.failed"),
        ("whk-2", "job.failed"),
    ]
    failed = rows[-1].payload
    assert failed["type"] == "job.failed" and failed["data"]["status"] == "failed"
    assert failed["data"]["id"] == JOB and failed["data"]["finished_at"] is not None
    assert failed["data"]["error"]["message"] == f"disk full under {JOB}/checkpoints"  # no server path
    assert rows[1].event_id == rows[2].event_id  # one event, one id, whichever endpoint gets it


def test_a_5xx_is_retried_and_a_jobs_events_arrive_in_order(
    db: Database, resolve_to: Callable[[str], None]
) -> None:
    resolve_to("93.184.216.34")
    secret = _endpoint(db, "https://hooks.example.com/in?x=1")
    _move(db, ("queued", "running"), ("running", "cancelling"), ("cancelling", "cancelled"))
    received: list[httpx.Request] = []

    def receiver(request: httpx.Request) -> httpx.Response:
        received.append(request)
        return httpx.Response(500 if len(received) == 1 else 204)

    _deliver(db, receiver, lambda: all(r.status == "delivered" for r in _deliveries(db)))
    bodies = [verify_webhook(secret, r.headers, r.content) for r in received]
    assert [b["type"] for b in bodies] == ["job.running", "job.running", "job.cancelled"]
    assert received[0].headers["webhook-id"] == received[1].headers["webhook-id"]  # a retry: same id
    first = received[0]
    # Sent to the checked address; the name goes in Host and TLS SNI; no redirect followed.
    assert str(first.url) == "https://93.184.216.34/in?x=1"
    assert first.headers["host"] == "hooks.example.com"
    assert first.extensions["sni_hostname"] == "hooks.example.com"
    seqs = [r.seq for r in _deliveries(db)]
    assert _attempts(db) == [(seqs[0], 1, 500), (seqs[0], 2, 204), (seqs[1], 1, 204)]


def test_refused_redirected_and_exhausted_deliveries_fail_and_let_the_next_through(
    db: Database, resolve_to: Callable[[str], None]
) -> None:
    resolve_to("10.0.0.7")  # the name now points into the cluster (DNS rebinding)
    _endpoint(db, "https://rebound.example.com/", ["job.running"])
    _move(db, ("queued", "running"))
    sent: list[httpx.Request] = []
    _deliver(
        db, lambda r: sent.append(r) or httpx.Response(200), lambda: _deliveries(db)[0].status != "pending"
    )
    assert sent == [] and _deliveries(db)[0].status == "failed"
    with db.session() as session:
        error = session.scalars(select(WebhookAttempt.error)).one()
    assert error is not None and "url refused" in error and "10.0.0.7" in error

    resolve_to("93.184.216.34")
    _endpoint(db, "https://slow.example.com/", ["job.paused", "job.cancelled"])
    _move(db, ("running", "pausing"), ("pausing", "paused"), ("paused", "cancelled"))

    def receiver(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        if b"job.paused" in request.content:
            return httpx.Response(503)  # every time: runs out of attempts
        return httpx.Response(302, headers={"Location": "http://169.254.169.254/"})

    _deliver(
        db, receiver, lambda: all(r.status != "pending" for r in _deliveries(db)), webhook_max_attempts=3
    )
    assert [b"job.paused" in r.content for r in sent] == [True, True, True, False]
    assert [r.status for r in _deliveries(db)] == ["failed", "failed", "failed"]
    assert [code for *_, code in _attempts(db)][-4:] == [503, 503, 503, 302]
    assert all(r.url.host == "93.184.216.34" for r in sent)  # the redirect was not followed
