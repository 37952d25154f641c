"""Webhooks: a tenant's endpoints, the outbox of deliveries, and the delivery log.

`enqueue` runs inside every job status change (`api.services.jobs.compare_and_set`, which the API's
transitions and the scheduler both use), in its transaction: one `WebhookDelivery` row per endpoint of
the job's tenant that wants the event. So an event is written exactly when the status change commits,
and a server that dies before sending it sends it after its restart (at least once). The deliverer
(`webhooks_delivery.py`) sends them; the helpers it runs in a thread are here.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from api.errors import APIError, not_found
from api.models import Job, WebhookAttempt, WebhookDelivery, WebhookEndpoint
from api.services import server_paths
from api.services.ids import new_id
from api.webhooks_urls import AllowedHosts, UrlRefused, vet
from opd_trainer.client.webhooks import new_secret
from opd_trainer.storage.run_dir import RunDir
from opd_trainer.wire.schemas import (
    WEBHOOK_EVENT_TYPES,
    JobError,
    WebhookAttemptPublic,
    WebhookCreate,
    WebhookDeliveryList,
    WebhookDeliveryPublic,
    WebhookEvent,
    WebhookJob,
    WebhookList,
    WebhookPublic,
)

# Job status → the event a move to it sends (pausing/cancelling/queued send none).
STATUS_EVENTS = {event.removeprefix("job."): event for event in WEBHOOK_EVENT_TYPES}
# A claimed delivery whose attempt has not been recorded after this long past its timeout is free
# again (its server process died mid-attempt).
CLAIM_MARGIN_S = 10.0


# -- endpoints --------------------------------------------------------------------------------------


def _public(endpoint: WebhookEndpoint, secret: str | None = None) -> WebhookPublic:
    return WebhookPublic.model_validate(endpoint).model_copy(update={"secret": secret})


def create(
    session: Session, tenant_id: str, body: WebhookCreate, allowed: AllowedHosts, max_endpoints: int
) -> WebhookPublic:
    """A new endpoint; its URL is checked (and resolved) first, its secret returned this once."""
    try:
        vet(body.url, allowed)
    except UrlRefused as exc:
        raise APIError(400, "invalid_url", f"url {exc.message}", "url") from None
    count = session.scalar(
        select(func.count()).select_from(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant_id)
    )
    if (count or 0) >= max_endpoints:
        raise APIError(
            429,
            "too_many_webhooks",
            f"a tenant may register at most {max_endpoints} webhook endpoints; delete one first",
            "url",
        )
    events = list(dict.fromkeys(body.events)) if body.events else list(WEBHOOK_EVENT_TYPES)
    secret = new_secret()
    endpoint = WebhookEndpoint(
        id=new_id("whk"),
        tenant_id=tenant_id,
        url=body.url,
        events=events,
        description=body.description,
        secret=secret,
        created_at=int(time.time()),
    )
    session.add(endpoint)
    session.commit()
    return _public(endpoint, secret)


def get_owned(
    session: Session, tenant_id: str, webhook_id: str, param: str = "webhook_id"
) -> WebhookEndpoint:
    endpoint = session.scalar(select(WebhookEndpoint).where(WebhookEndpoint.id == webhook_id))
    if endpoint is None or endpoint.tenant_id != tenant_id:
        raise not_found("webhook", webhook_id, param)
    return endpoint


def list_endpoints(session: Session, tenant_id: str) -> WebhookList:
    rows = session.scalars(
        select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant_id).order_by(WebhookEndpoint.pk)
    )
    return WebhookList(data=[_public(e) for e in rows])


def get(session: Session, tenant_id: str, webhook_id: str) -> WebhookPublic:
    return _public(get_owned(session, tenant_id, webhook_id))


def remove(session: Session, tenant_id: str, webhook_id: str) -> None:
    """Deletes the endpoint, its pending deliveries and its log."""
    endpoint = get_owned(session, tenant_id, webhook_id)
    seqs = select(WebhookDelivery.seq).where(WebhookDelivery.endpoint_id == endpoint.id)
    session.execute(delete(WebhookAttempt).where(WebhookAttempt.delivery_seq.in_(seqs)))
    session.execute(delete(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint.id))
    session.delete(endpoint)
    session.commit()


# -- the outbox -------------------------------------------------------------------------------------


def enqueue(session: Session, job_id: str, status: str) -> int:
    """Writes the deliveries of `job_id`'s move to `status` (already made in this transaction) for every
    endpoint of its tenant that wants it; returns how many. Committed with the status change."""
    event_type = STATUS_EVENTS.get(status)
    if event_type is None:
        return 0
    job = session.execute(
        select(
            Job.tenant_id,
            Job.job_name,
            Job.status,
            Job.created_at,
            Job.started_at,
            Job.finished_at,
            Job.error,
            Job.run_dir,
        ).where(Job.id == job_id)
    ).one_or_none()
    if job is None:
        return 0
    endpoints = [
        endpoint_id
        for endpoint_id, events in session.execute(
            select(WebhookEndpoint.id, WebhookEndpoint.events).where(
                WebhookEndpoint.tenant_id == job.tenant_id
            )
        )
        if event_type in (events or [])
    ]
    if not endpoints:
        return 0
    error = None
    if job.error:
        data_dir = Path(job.run_dir).parent.parent  # as server_paths.data_dir_of
        message = server_paths.public_text(str(job.error.get("message", "")), data_dir)
        error = JobError.model_validate({**job.error, "message": message})
    now = time.time()
    event = WebhookEvent(
        id=new_id("evt"),
        type=event_type,  # type: ignore[arg-type]  # a value of STATUS_EVENTS
        created_at=now,
        data=WebhookJob(
            id=job_id,
            job_name=job.job_name,
            status=status,  # type: ignore[arg-type]  # a JobStatus: a key of STATUS_EVENTS
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            # A dry run's calibration trains no model to hand out.
            fine_tuned_model=RunDir(job.run_dir).fine_tuned_model_id()
            if status == "succeeded" and job.dry_run is None
            else None,
            error=error,
        ),
    )
    payload = event.model_dump(mode="json")
    for endpoint_id in endpoints:
        session.add(
            WebhookDelivery(
                id=new_id("whdel"),
                endpoint_id=endpoint_id,
                job_id=job_id,
                event_id=event.id,
                event_type=event_type,
                payload=payload,
                status="pending",
                attempts=0,
                created_at=now,
                next_attempt_at=now,
                locked_until=0.0,
            )
        )
    return len(endpoints)


# -- the deliverer's side (run in a thread) ---------------------------------------------------------


def due(session: Session, now: float, limit: int, busy: set[int]) -> list[int]:
    """Up to `limit` pending deliveries to attempt now: each the earliest pending one of its job and
    endpoint (a job's later event waits for its earlier ones), unclaimed, its time come, not in `busy`."""
    earlier = WebhookDelivery.__table__.alias("earlier")
    head = (
        select(func.min(earlier.c.seq))
        .where(
            earlier.c.endpoint_id == WebhookDelivery.endpoint_id,
            earlier.c.job_id == WebhookDelivery.job_id,
            earlier.c.status == "pending",
        )
        .scalar_subquery()
    )
    query = (
        select(WebhookDelivery.seq)
        .where(
            WebhookDelivery.status == "pending",
            WebhookDelivery.next_attempt_at <= now,
            WebhookDelivery.locked_until <= now,
            WebhookDelivery.seq == head,
        )
        .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.seq)
        .limit(limit + len(busy))
    )
    return [seq for seq in session.scalars(query) if seq not in busy][:limit]


def claim(session: Session, seq: int, now: float, hold_s: float) -> dict[str, Any] | None:
    """Takes delivery `seq` for one attempt (no other process takes it for `hold_s` + a margin); what
    the attempt needs, or None if another process took it first or it is gone."""
    taken = session.execute(
        update(WebhookDelivery)
        .where(
            WebhookDelivery.seq == seq,
            WebhookDelivery.status == "pending",
            WebhookDelivery.locked_until <= now,
        )
        .values(locked_until=now + hold_s + CLAIM_MARGIN_S)
        .execution_options(synchronize_session=False)
    )
    if not taken.rowcount:  # type: ignore[attr-defined]
        session.rollback()
        return None
    row = session.execute(
        select(
            WebhookDelivery.event_id,
            WebhookDelivery.payload,
            WebhookDelivery.attempts,
            WebhookEndpoint.url,
            WebhookEndpoint.secret,
        )
        .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
        .where(WebhookDelivery.seq == seq)
    ).one_or_none()
    session.commit()
    if row is None:
        return None
    return {
        "seq": seq,
        "event_id": row.event_id,
        "payload": row.payload,
        "number": row.attempts + 1,
        "url": row.url,
        "secret": row.secret,
    }


def record(
    session: Session,
    seq: int,
    number: int,
    at: float,
    status_code: int | None,
    error: str | None,
    duration_ms: float,
    outcome: str,
    next_attempt_at: float | None,
) -> None:
    """Logs one attempt and moves the delivery on: `outcome` delivered, failed or pending (retry at
    `next_attempt_at`); releases its claim."""
    if session.get(WebhookDelivery, seq) is None:
        return  # its endpoint was deleted meanwhile
    session.add(
        WebhookAttempt(
            delivery_seq=seq,
            number=number,
            at=at,
            status_code=status_code,
            error=error[:2000] if error else None,
            duration_ms=round(duration_ms, 1),
        )
    )
    values: dict[str, Any] = {"attempts": number, "status": outcome, "locked_until": 0.0}
    if outcome == "pending":
        values["next_attempt_at"] = next_attempt_at
    else:
        values["finished_at"] = time.time()
    session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.seq == seq)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    session.commit()


def prune(session: Session, before: float) -> int:
    """Deletes delivered and failed deliveries (and their attempts) finished before `before`."""
    old = select(WebhookDelivery.seq).where(
        WebhookDelivery.status != "pending", WebhookDelivery.finished_at < before
    )
    session.execute(delete(WebhookAttempt).where(WebhookAttempt.delivery_seq.in_(old)))
    result = session.execute(
        delete(WebhookDelivery).where(
            WebhookDelivery.status != "pending", WebhookDelivery.finished_at < before
        )
    )
    session.commit()
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


# -- the log ----------------------------------------------------------------------------------------


def deliveries(
    session: Session, tenant_id: str, webhook_id: str, after: str | None, limit: int, job_id: str | None
) -> WebhookDeliveryList:
    """The endpoint's deliveries, newest first, each with its attempts; `after` is the last delivery id
    of the previous page."""
    endpoint = get_owned(session, tenant_id, webhook_id)
    query = select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint.id)
    if job_id is not None:
        query = query.where(WebhookDelivery.job_id == job_id)
    if after is not None:
        cursor = session.scalar(
            select(WebhookDelivery.seq).where(
                WebhookDelivery.id == after, WebhookDelivery.endpoint_id == endpoint.id
            )
        )
        if cursor is None:
            raise not_found("webhook delivery", after, "after")
        query = query.where(WebhookDelivery.seq < cursor)
    rows = list(session.scalars(query.order_by(WebhookDelivery.seq.desc()).limit(limit + 1)))
    page = rows[:limit]
    attempts: dict[int, list[WebhookAttemptPublic]] = {row.seq: [] for row in page}
    if page:
        for attempt in session.scalars(
            select(WebhookAttempt)
            .where(WebhookAttempt.delivery_seq.in_(list(attempts)))
            .order_by(WebhookAttempt.id)
        ):
            attempts[attempt.delivery_seq].append(WebhookAttemptPublic.model_validate(attempt))
    return WebhookDeliveryList(
        data=[
            WebhookDeliveryPublic(
                id=row.id,
                event_id=row.event_id,
                event_type=row.event_type,  # type: ignore[arg-type]  # written from STATUS_EVENTS
                job_id=row.job_id,
                status=row.status,  # type: ignore[arg-type]  # pending, delivered or failed
                created_at=row.created_at,
                next_attempt_at=row.next_attempt_at if row.status == "pending" else None,
                finished_at=row.finished_at,
                payload=row.payload,
                attempts=attempts[row.seq],
            )
            for row in page
        ],
        has_more=len(rows) > limit,
    )
