"""SQLAlchemy tables: tenants, their API keys, uploaded files, jobs and every job's events, webhook endpoints
and their deliveries."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from api.db import Base


def now() -> int:
    return int(time.time())


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True, index=True)
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    # What the tenant's deleted jobs had used (`driver/metering.py` keys): deleting a job keeps its usage.
    deleted_jobs_usage: Mapped[dict[str, float]] = mapped_column(JSON, default=dict)


class ApiKey(Base):
    """A tenant's key; only its sha256 is stored, and its first characters to tell keys apart."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    revoked_at: Mapped[int | None] = mapped_column(Integer, default=None)


class File(Base):
    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(16))
    bytes: Mapped[int] = mapped_column(BigInteger)
    path: Mapped[str] = mapped_column(Text)
    # Datasets: validated sample count; workspaces: the extracted directory and its entry count.
    samples: Mapped[int | None] = mapped_column(Integer, default=None)
    extracted_dir: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    # What the file takes on the server (the upload plus what its zip extracted to), counted against
    # the tenant's quota; None for files stored before quotas existed (counted as `bytes`).
    stored_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)


class Job(Base):
    """One submitted job. `pk` orders the queue and the listing; `id` is what users see."""

    __tablename__ = "jobs"

    pk: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, index=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    job_name: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(24), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    file_ids: Mapped[list[str]] = mapped_column(JSON, default=list)
    run_dir: Mapped[str] = mapped_column(Text)
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    queued_at: Mapped[float] = mapped_column(Float, default=time.time)
    started_at: Mapped[int | None] = mapped_column(Integer, default=None)
    finished_at: Mapped[int | None] = mapped_column(Integer, default=None)
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int | None] = mapped_column(Integer, default=None)
    eta_s: Mapped[float | None] = mapped_column(Float, default=None)
    trained_tokens: Mapped[float] = mapped_column(Float, default=0.0)
    metrics: Mapped[dict[str, float]] = mapped_column(JSON, default=dict)
    # What the job used so far, over all its runs (`driver/metering.py`), as the driver last reported.
    usage: Mapped[dict[str, float]] = mapped_column(JSON, default=dict)
    # A dry run (`POST /v1/opd/jobs?dry_run=true`): {calibration_steps, total_steps}; null otherwise.
    dry_run: Mapped[dict[str, int] | None] = mapped_column(JSON, default=None)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # Which driver incarnation runs the job, and how many of its events are already copied here.
    driver_attempts: Mapped[int] = mapped_column(Integer, default=0)
    driver_restarts: Mapped[int] = mapped_column(Integer, default=0)
    # Lines in events.jsonl before the current driver started: the ones after it are its own.
    driver_events_offset: Mapped[int] = mapped_column(Integer, default=0)
    driver_event_seq: Mapped[int] = mapped_column(Integer, default=-1)


class JobEvent(Base):
    """A job's events: the driver's (copied by the scheduler) and the server's own status changes.

    `id` is global and increasing, so it is the cursor of `GET .../events?after=`.
    """

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    time: Mapped[float] = mapped_column(Float)
    type: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class SchedulerLease(Base):
    """Which server process schedules jobs: one at a time, however many API replicas share the database.

    The holder renews `expires_at` every poll; another replica takes over once it has passed (or at
    once when the holder released it, or ran on this host and its process is gone).
    """

    __tablename__ = "scheduler_lease"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    holder: Mapped[str] = mapped_column(String(200))
    expires_at: Mapped[float] = mapped_column(Float)


class WebhookEndpoint(Base):
    """A tenant's webhook receiver: where job status changes are POSTed, signed with `secret`.

    The secret is kept as given out (`whsec_<base64>`): signing needs it, so it cannot be a hash.
    """

    __tablename__ = "webhook_endpoints"

    pk: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, index=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    url: Mapped[str] = mapped_column(Text)
    events: Mapped[list[str]] = mapped_column(JSON, default=list)
    description: Mapped[str] = mapped_column(String(256), default="")
    secret: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[int] = mapped_column(Integer, default=now)


class WebhookDelivery(Base):
    """One event for one endpoint (the outbox): written in the transaction that changes the job's
    status, then POSTed by the deliverer until delivered or out of attempts.

    `seq` orders a job's events to one endpoint: a delivery is attempted only when no earlier one of
    the same job and endpoint is still pending. `locked_until` claims it for one attempt (so that
    several server processes never send it at once); a claim that outlives its process expires.
    """

    __tablename__ = "webhook_deliveries"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, index=True)
    endpoint_id: Mapped[str] = mapped_column(
        ForeignKey("webhook_endpoints.id", ondelete="CASCADE"), index=True
    )
    job_id: Mapped[str] = mapped_column(String(40), index=True)
    event_id: Mapped[str] = mapped_column(String(40))
    event_type: Mapped[str] = mapped_column(String(32))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), index=True)  # pending, delivered, failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    next_attempt_at: Mapped[float] = mapped_column(Float, default=time.time)
    locked_until: Mapped[float] = mapped_column(Float, default=0.0)
    finished_at: Mapped[float | None] = mapped_column(Float, default=None)


class WebhookAttempt(Base):
    """One POST of a delivery: what the receiver answered (or the error), and how long it took."""

    __tablename__ = "webhook_attempts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    delivery_seq: Mapped[int] = mapped_column(
        ForeignKey("webhook_deliveries.seq", ondelete="CASCADE"), index=True
    )
    number: Mapped[int] = mapped_column(Integer)
    at: Mapped[float] = mapped_column(Float)
    status_code: Mapped[int | None] = mapped_column(Integer, default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    duration_ms: Mapped[float] = mapped_column(Float)
