"""OPD jobs: submit, list, get, cancel/pause/resume, delete, and the run's events, logs, metrics, ...

`GET .../events` answers JSON pages (`after` cursor), or a server-sent-event stream when the request
asks for `Accept: text/event-stream` (what `EventSource` and `opd logs -f` send); the stream ends
with an `end` event once the job is finished and every event is sent.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse, StreamingResponse

from api.db import Database
from api.deps import DatabaseDep, SessionDep, SettingsDep, TenantDep
from api.errors import ERROR_RESPONSES
from api.schemas import (
    CheckpointList,
    Deleted,
    EventList,
    EventPublic,
    JobCreate,
    JobList,
    JobPublic,
    JobStatus,
    MetricsPublic,
    TrajectoryList,
)
from api.services import jobs
from api.services.states import TERMINAL

router = APIRouter(prefix="/v1/opd/jobs", tags=["jobs"], responses=ERROR_RESPONSES)

STREAM_POLL_S = 0.5
KEEPALIVE_S = 15.0
Cursor = Annotated[int, Query(ge=0, le=2**62, description="Return events with id greater than this.")]


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobPublic)
def create_job(body: JobCreate, session: SessionDep, settings: SettingsDep, tenant: TenantDep) -> JobPublic:
    return jobs.create(session, settings, tenant.id, body)


@router.get("", response_model=JobList)
def list_jobs(
    session: SessionDep,
    tenant: TenantDep,
    after: Annotated[
        str | None, Query(max_length=64, description="Last job id of the previous page.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    status: Annotated[JobStatus | None, Query()] = None,
) -> JobList:
    return jobs.list_jobs(session, tenant.id, after, limit, status)


@router.get("/{job_id}", response_model=JobPublic)
def get_job(job_id: str, session: SessionDep, tenant: TenantDep) -> JobPublic:
    return jobs.public(jobs.get_owned(session, tenant.id, job_id))


@router.post("/{job_id}/cancel", response_model=JobPublic)
def cancel_job(job_id: str, session: SessionDep, tenant: TenantDep) -> JobPublic:
    return jobs.transition(session, tenant.id, job_id, "cancel")


@router.post("/{job_id}/pause", response_model=JobPublic)
def pause_job(job_id: str, session: SessionDep, tenant: TenantDep) -> JobPublic:
    return jobs.transition(session, tenant.id, job_id, "pause")


@router.post("/{job_id}/resume", response_model=JobPublic)
def resume_job(job_id: str, session: SessionDep, tenant: TenantDep) -> JobPublic:
    return jobs.transition(session, tenant.id, job_id, "resume")


@router.delete("/{job_id}", response_model=Deleted)
def delete_job(job_id: str, session: SessionDep, tenant: TenantDep) -> Deleted:
    jobs.delete(session, tenant.id, job_id)
    return Deleted(id=job_id, object="opd.job")


@router.get(
    "/{job_id}/events",
    response_model=EventList,
    description="A page of events after the `after` cursor; with `Accept: text/event-stream`, a "
    "server-sent-event stream (`id`, `event` = type, `data` = the event) that ends with an `end` event "
    "carrying the finished job.",
)
def list_events(
    job_id: str,
    request: Request,
    session: SessionDep,
    db: DatabaseDep,
    tenant: TenantDep,
    after: Cursor = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    accept: Annotated[str | None, Header(include_in_schema=False)] = None,
    last_event_id: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> EventList | StreamingResponse:
    page = jobs.list_events(session, tenant.id, job_id, after, limit)
    if accept is None or "text/event-stream" not in accept:
        return page
    if last_event_id is not None and last_event_id.isdigit():
        after = int(last_event_id)  # a reconnecting EventSource continues where it stopped
    # The stream may last hours: end this request's read transaction now (an open one would keep
    # SQLite from checkpointing its WAL); each turn of the stream uses a short session of its own.
    session.close()
    return StreamingResponse(
        _stream(request, db, job_id, after),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _read(db: Database, job_id: str, after: int) -> tuple[list[EventPublic], JobPublic | None]:
    with db.session() as session:
        return jobs.stream_snapshot(session, job_id, after)


async def _stream(request: Request, db: Database, job_id: str, after: int) -> AsyncIterator[str]:
    last_sent = time.monotonic()
    while True:
        events, job = await run_in_threadpool(_read, db, job_id, after)
        for event in events:
            after = event.id
            yield f"id: {event.id}\nevent: {event.type}\ndata: {event.model_dump_json()}\n\n"
            last_sent = time.monotonic()
        if job is None or (job.status in TERMINAL and not events):
            payload = job.model_dump_json() if job else json.dumps({"id": job_id, "deleted": True})
            yield f"event: end\ndata: {payload}\n\n"
            return
        if time.monotonic() - last_sent > KEEPALIVE_S:
            yield ": keep-alive\n\n"
            last_sent = time.monotonic()
        if await request.is_disconnected():
            return
        if request.app.state.shutting_down.is_set():
            # The server is stopping (a restart, a rolling update): say so; clients reconnect.
            yield f"event: shutdown\ndata: {json.dumps({'id': job_id, 'after': after})}\n\n"
            return
        if not events:
            await asyncio.sleep(STREAM_POLL_S)


@router.get(
    "/{job_id}/logs", response_class=PlainTextResponse, responses={200: {"content": {"text/plain": {}}}}
)
def job_logs(
    job_id: str,
    session: SessionDep,
    tenant: TenantDep,
    after: Cursor = 0,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
) -> PlainTextResponse:
    return PlainTextResponse(jobs.logs(session, tenant.id, job_id, after, limit))


@router.get("/{job_id}/checkpoints", response_model=CheckpointList)
def job_checkpoints(job_id: str, session: SessionDep, tenant: TenantDep) -> CheckpointList:
    return jobs.checkpoints(session, tenant.id, job_id)


@router.get("/{job_id}/metrics", response_model=MetricsPublic)
def job_metrics(job_id: str, session: SessionDep, tenant: TenantDep) -> MetricsPublic:
    return jobs.metrics(session, tenant.id, job_id)


@router.get("/{job_id}/trajectories", response_model=TrajectoryList)
def job_trajectories(
    job_id: str, session: SessionDep, tenant: TenantDep, limit: Annotated[int, Query(ge=1, le=200)] = 16
) -> TrajectoryList:
    return jobs.trajectories(session, tenant.id, job_id, limit)
