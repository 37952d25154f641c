"""SQLAlchemy tables: tenants, their API keys, uploaded files, jobs and every job's events."""

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
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # Which driver incarnation runs the job, and how many of its events are already copied here.
    driver_attempts: Mapped[int] = mapped_column(Integer, default=0)
    driver_restarts: Mapped[int] = mapped_column(Integer, default=0)
    # Records in events.jsonl before the current driver started: the ones after it are its own.
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
