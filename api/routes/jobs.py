"""OPD jobs: submit, list, get, cancel/pause/resume, delete, and the run's events, logs, metrics, ...

`GET .../events` answers JSON pages (`after` cursor, at most 1000 events), or a server-sent-event
stream when the request asks for `Accept: text/event-stream` (what `EventSource` and `opd logs -f`
send); the stream ends with an `end` event once the job is finished and every event is sent. A
stream is bounded: at most `event_streams_per_tenant` open at once per tenant, each at most
`event_stream_max_s` long, after which it ends with a `reconnect` event (the client continues from
its cursor); each turn reads at most 500 events (`jobs.stream_snapshot`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Literal

import anyio
from fastapi import APIRouter, Header, Query, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse, StreamingResponse
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask

from api.db import Database
from api.deps import DatabaseDep, SessionDep, SettingsDep, StreamSlotsDep, TenantDep
from api.errors import TENANT, errors
from api.services import jobs, trajectories
from api.services.states import TERMINAL
from opd_trainer.jobspec.job_status import JobStatus
from opd_trainer.storage.zip_stream import stream_zip
from opd_trainer.wire.schemas import (
    CheckpointList,
    Deleted,
    EventList,
    EventPublic,
    JobCreate,
    JobList,
    JobPublic,
    MetricsPublic,
    TrajectoryList,
    TrajectorySort,
    ValidationTrajectoryList,
    ValidationTrajectorySort,
)

router = APIRouter(prefix="/v1/opd/jobs", tags=["jobs"])

STREAM_POLL_S = 0.5
KEEPALIVE_S = 15.0
# Longer than one poll: an open stream sees the shutdown and sends its `shutdown` event in time.
SHUTDOWN_GRACE_S = 4 * STREAM_POLL_S
Cursor = Annotated[int, Query(ge=0, le=2**62, description="Return events with id greater than this.")]


# Submissions run at most this many at a time. Pre-flight is CPU-bound Python: 20 submissions in 20
# threads at once made every status read wait its turn for the GIL behind them (poll p99 470 ms in
# that second vs 25 ms without; benchmarks/api_load.py); queued submissions wait here,
# holding no thread, and reads go on.
SUBMISSIONS_AT_ONCE = 2
_submissions = anyio.CapacityLimiter(SUBMISSIONS_AT_ONCE)


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=JobPublic,
    responses=errors(400, *TENANT, 404, 413, 422, 429),
)
async def create_job(
    body: JobCreate,
    session: SessionDep,
    settings: SettingsDep,
    tenant: TenantDep,
    dry_run: Annotated[
        bool,
        Query(
            description="Run a short calibration of the job (its first steps, validating after the first) "
            "instead of the job, for an estimate of what the whole job would use: `dry_run.estimate` once it "
            "succeeded. Queued, metered and cancellable like a job; never gives a fine_tuned_model."
        ),
    ] = False,
) -> JobPublic:
    return await anyio.to_thread.run_sync(
        jobs.create, session, settings, tenant.id, body, dry_run, limiter=_submissions
    )


@router.get("", response_model=JobList, responses=errors(*TENANT, 404, 422))
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


@router.get("/{job_id}", response_model=JobPublic, responses=errors(*TENANT, 404))
def get_job(job_id: str, session: SessionDep, tenant: TenantDep) -> JobPublic:
    return jobs.public(jobs.get_owned(session, tenant.id, job_id))


@router.post("/{job_id}/cancel", response_model=JobPublic, responses=errors(*TENANT, 404, 409))
def cancel_job(job_id: str, session: SessionDep, tenant: TenantDep) -> JobPublic:
    return jobs.transition(session, tenant.id, job_id, "cancel")


@router.post("/{job_id}/pause", response_model=JobPublic, responses=errors(*TENANT, 404, 409))
def pause_job(job_id: str, session: SessionDep, tenant: TenantDep) -> JobPublic:
    return jobs.transition(session, tenant.id, job_id, "pause")


@router.post("/{job_id}/resume", response_model=JobPublic, responses=errors(*TENANT, 404, 409))
def resume_job(job_id: str, session: SessionDep, tenant: TenantDep) -> JobPublic:
    return jobs.transition(session, tenant.id, job_id, "resume")


@router.delete("/{job_id}", response_model=Deleted, responses=errors(*TENANT, 404, 409))
def delete_job(job_id: str, session: SessionDep, tenant: TenantDep) -> Deleted:
    jobs.delete(session, tenant.id, job_id)
    return Deleted(id=job_id, object="opd.job")


@router.get(
    "/{job_id}/events",
    response_model=EventList,
    description="A page of events after the `after` cursor; with `Accept: text/event-stream`, a "
    "server-sent-event stream (`id`, `event` = type, `data` = the event) that ends with an `end` event "
    "carrying the finished job.",
    responses={
        200: {
            "content": {
                "text/event-stream": {
                    "schema": {"type": "string"},
                    "example": 'id: 7\nevent: step\ndata: {"id": 7, "type": "step", ...}\n\n',
                }
            },
            "description": "A page of events (JSON), or the event stream (`Accept: text/event-stream`).",
        },
        **errors(*TENANT, 404, 422),
    },
)
def list_events(
    job_id: str,
    session: SessionDep,
    db: DatabaseDep,
    settings: SettingsDep,
    streams: StreamSlotsDep,
    tenant: TenantDep,
    after: Cursor = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    accept: Annotated[str | None, Header(include_in_schema=False)] = None,
    last_event_id: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> EventList | EventSourceResponse:
    page = jobs.list_events(session, tenant.id, job_id, after, limit)
    if accept is None or "text/event-stream" not in accept:
        return page
    if last_event_id is not None and last_event_id.isdigit():
        after = int(last_event_id)  # a reconnecting EventSource continues where it stopped
    # The stream may last hours: end this request's read transaction now (an open one would keep
    # SQLite from checkpointing its WAL); each turn of the stream uses a short session of its own.
    session.close()
    # sse-starlette sets `shutdown` when the server is stopping (a restart, a rolling update) and gives
    # the stream a grace period to say so before it is closed; clients then reconnect.
    shutdown = anyio.Event()
    # Released when the stream ends, whichever way: its own end, the client leaving, a HEAD request.
    release = streams.acquire(tenant.id)
    return EventSourceResponse(
        _stream(db, job_id, after, shutdown, time.monotonic() + settings.event_stream_max_s, release),
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        ping=KEEPALIVE_S,
        shutdown_event=shutdown,
        shutdown_grace_period=SHUTDOWN_GRACE_S,
        background=BackgroundTask(release),
    )


def _read(db: Database, job_id: str, after: int) -> tuple[list[EventPublic], JobPublic | None]:
    with db.session() as session:
        return jobs.stream_snapshot(session, job_id, after)


async def _stream(
    db: Database,
    job_id: str,
    after: int,
    shutdown: anyio.Event,
    deadline: float,
    release: Callable[[], None],
) -> AsyncIterator[ServerSentEvent]:
    """The job's events after `after`, then `end` (the finished job), `shutdown` (the server stops) or
    `reconnect` (the stream reached its longest, `deadline` on the monotonic clock); `release` frees
    the tenant's stream slot."""
    try:
        while True:
            events, job = await run_in_threadpool(_read, db, job_id, after)
            for event in events:
                after = event.id
                yield ServerSentEvent(data=event.model_dump_json(), event=event.type, id=str(event.id))
            if job is None or (job.status in TERMINAL and not events):
                payload = job.model_dump_json() if job else json.dumps({"id": job_id, "deleted": True})
                yield ServerSentEvent(data=payload, event="end")
                return
            if shutdown.is_set():
                yield ServerSentEvent(data=json.dumps({"id": job_id, "after": after}), event="shutdown")
                return
            if time.monotonic() >= deadline:
                yield ServerSentEvent(data=json.dumps({"id": job_id, "after": after}), event="reconnect")
                return
            if not events:
                await asyncio.sleep(STREAM_POLL_S)
    finally:
        release()


@router.get(
    "/{job_id}/logs",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {}}}, **errors(*TENANT, 404, 422)},
)
def job_logs(
    job_id: str,
    session: SessionDep,
    tenant: TenantDep,
    after: Cursor = 0,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
) -> PlainTextResponse:
    return PlainTextResponse(jobs.logs(session, tenant.id, job_id, after, limit))


@router.get("/{job_id}/checkpoints", response_model=CheckpointList, responses=errors(*TENANT, 404))
def job_checkpoints(job_id: str, session: SessionDep, tenant: TenantDep) -> CheckpointList:
    return jobs.checkpoints(session, tenant.id, job_id)


@router.get(
    "/{job_id}/checkpoints/{checkpoint_id}/content",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"application/zip": {"schema": {"type": "string", "format": "binary"}}},
            "description": "The student model folder, zipped.",
        },
        **errors(*TENANT, 404),
    },
    description="The checkpoint's student as a zip of its Hugging Face model folder (config, tokenizer, "
    "safetensors weights) under one top folder; `fine_tuned_model` names the final one. A LoRA job's "
    "checkpoint is its adapter folder (PEFT's adapter_config.json and adapter_model.safetensors, the "
    "tokenizer); with `merged=true`, the base model with the adapter merged in (made on the first such "
    "request, kept beside the checkpoint).",
)
def checkpoint_content(
    job_id: str,
    checkpoint_id: str,
    session: SessionDep,
    tenant: TenantDep,
    merged: Annotated[bool, Query(description="A LoRA checkpoint as its merged model.")] = False,
) -> StreamingResponse:
    folder = jobs.checkpoint_model(session, tenant.id, job_id, checkpoint_id, merged)
    name = f"{job_id}-{checkpoint_id}"
    return StreamingResponse(
        stream_zip(folder, name),
        media_type="application/zip",
        headers={"Content-Disposition": f'attachment; filename="{name}.zip"'},
    )


@router.get("/{job_id}/metrics", response_model=MetricsPublic, responses=errors(*TENANT, 404))
def job_metrics(job_id: str, session: SessionDep, tenant: TenantDep) -> MetricsPublic:
    return jobs.metrics(session, tenant.id, job_id)


# A page of run-dir records (trajectories, validation trajectories): at most 200, from an offset.
RecordPageLimit = Annotated[int, Query(ge=1, le=200)]
RecordPageOffset = Annotated[int, Query(ge=0, le=10**6, description="Skip this many (the page's start).")]


@router.get(
    "/{job_id}/trajectories",
    response_model=TrajectoryList,
    responses=errors(*TENANT, 404, 422),
    description="A page of the job's recorded rollouts (the first 16 of each step). Without `step` and "
    "`sort`: the latest `limit` written before the `offset` latest, in the order written. With either: "
    "that step's (else every step's) rollouts ordered by `sort` and `order`; those without the value "
    "(a failed rollout has no reward and no trained tokens) come last.",
)
def job_trajectories(
    job_id: str,
    session: SessionDep,
    tenant: TenantDep,
    limit: RecordPageLimit = 16,
    offset: RecordPageOffset = 0,
    step: Annotated[
        int | None, Query(ge=0, description="Only this step's rollouts (`steps` lists them).")
    ] = None,
    sort: Annotated[
        TrajectorySort | None,
        Query(
            description="`recent`: as written; `reward`; `divergence`: mean sampler − teacher logprob "
            "over the trajectory's trained tokens."
        ),
    ] = None,
    order: Annotated[
        Literal["desc", "asc"], Query(description="`desc`: highest (or newest) first.")
    ] = "desc",
) -> TrajectoryList:
    return trajectories.trajectory_page(
        session, tenant.id, job_id, step=step, sort=sort, order=order, limit=limit, offset=offset
    )


@router.get(
    "/{job_id}/validation_trajectories",
    response_model=ValidationTrajectoryList,
    responses=errors(*TENANT, 404, 422),
    description="A page of the job's recorded validation rollouts (the first 16 of each validation pass, by "
    "sample order) matching every filter given, as written or sorted; `passes` lists every recorded "
    "pass (step, label, model) whatever the filters, so two can be compared sample by sample.",
)
def job_validation_trajectories(
    job_id: str,
    session: SessionDep,
    tenant: TenantDep,
    limit: RecordPageLimit = 16,
    offset: RecordPageOffset = 0,
    step: Annotated[
        int | None, Query(ge=0, description="Only this step's passes (`steps` lists them).")
    ] = None,
    label: Annotated[
        str | None,
        Query(max_length=200, description="Only this pass label: `teacher`, `student before`, `step N`, ..."),
    ] = None,
    model: Annotated[
        Literal["student", "teacher"] | None, Query(description="Only the student's or the teacher's.")
    ] = None,
    sample_id: Annotated[
        str | None, Query(max_length=500, description="Only this validation sample.")
    ] = None,
    sort: Annotated[
        ValidationTrajectorySort,
        Query(
            description="`recent`: as written; `score`: the evaluator's; `reward`; `divergence`: the "
            "student's mean logprob − the teacher's over the tokens it wrote (the teacher's own rollouts "
            "have none). Rollouts without the value come last."
        ),
    ] = "recent",
    order: Annotated[Literal["desc", "asc"], Query(description="`desc`: highest (or newest) first.")] = "asc",
) -> ValidationTrajectoryList:
    return trajectories.validation_trajectory_page(
        session,
        tenant.id,
        job_id,
        step=step,
        label=label,
        model=model,
        sample_id=sample_id,
        sort=sort,
        order=order,
        limit=limit,
        offset=offset,
    )
