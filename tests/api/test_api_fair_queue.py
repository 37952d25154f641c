"""Which queued jobs the scheduler starts: round-robin across tenants and at most
`max_concurrent_jobs_per_tenant` of one tenant, on a real SQLite file (no Ray: only the choice)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.db import Database, migrate
from api.models import Job, Tenant
from api.services.scheduler import fair_queue
from api.settings import Settings


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Database]:
    db = Database(f"sqlite:///{tmp_path / 'opd.db'}")
    migrate(db.engine)
    with db.session() as session:
        session.add_all([Tenant(id=name, name=name) for name in ("a", "b", "c")])
        session.commit()
    yield db
    db.engine.dispose()


_clock = itertools.count(1)


def add_jobs(db: Database, tenant: str, count: int, status: str = "queued") -> list[str]:
    """`count` jobs of `tenant`, each queued after every job added before it."""
    ids = []
    with db.session() as session:
        for _ in range(count):
            at = next(_clock)
            job_id = f"job-{tenant}-{at}"
            session.add(
                Job(
                    id=job_id,
                    tenant_id=tenant,
                    job_name="j",
                    status=status,
                    spec={},
                    run_dir="",
                    queued_at=at,
                )
            )
            ids.append(job_id)
        session.commit()
    return ids


def picked(db: Database, free: int, per_tenant: int) -> list[str]:
    with db.session() as session:
        return fair_queue(session, free, per_tenant)


def test_one_tenants_backlog_does_not_queue_the_others_behind_it(database: Database) -> None:
    a = add_jobs(database, "a", 4)  # submitted first
    b = add_jobs(database, "b", 2)
    c = add_jobs(database, "c", 1)
    # Oldest-first would start a[0..3]; round-robin gives each tenant one, then the oldest again.
    assert picked(database, free=4, per_tenant=4) == [a[0], b[0], c[0], a[1]]
    assert picked(database, free=7, per_tenant=4) == [a[0], b[0], c[0], a[1], b[1], a[2], a[3]]


def test_a_tenant_holding_drivers_goes_after_tenants_holding_none(database: Database) -> None:
    add_jobs(database, "a", 1, status="running")
    add_jobs(database, "a", 1, status="cancelling")  # a stuck cancel still holds its slot
    a = add_jobs(database, "a", 2)
    b = add_jobs(database, "b", 1)
    assert picked(database, free=1, per_tenant=8) == [b[0]]
    assert picked(database, free=3, per_tenant=8) == [b[0], a[0], a[1]]


def test_per_tenant_limit(database: Database) -> None:
    add_jobs(database, "a", 1, status="pausing")
    a = add_jobs(database, "a", 3)
    b = add_jobs(database, "b", 2)
    add_jobs(database, "c", 1, status="paused")  # holds no driver, and is not queued
    assert picked(database, free=3, per_tenant=1) == [b[0]]
    assert picked(database, free=3, per_tenant=2) == [b[0], a[0], b[1]]
    assert picked(database, free=0, per_tenant=2) == []


def test_the_per_tenant_limit_defaults_to_the_service_limit() -> None:
    assert Settings(max_concurrent_jobs=3).tenant_slots == 3
    assert Settings(max_concurrent_jobs=3, max_concurrent_jobs_per_tenant=1).tenant_slots == 1
