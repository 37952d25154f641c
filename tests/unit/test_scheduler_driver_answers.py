"""What the scheduler reads from a driver survives an upgrade: a driver of an earlier build answers its
polls with dicts, and a run dir may hold events this build does not know or a half-written last line.
Ray's `get` is replaced by one that hands the answers back, so no cluster runs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from sqlalchemy import select

from api.db import Database, migrate
from api.models import Job, JobEvent, Tenant
from api.services.scheduler import DriverHandle, Scheduler
from api.settings import Settings
from opd_trainer.storage.run_dir import RunDir
from opd_trainer.wire.driver import DriverEvent, DriverProgress


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Database]:
    db = Database(f"sqlite:///{tmp_path / 'opd.db'}")
    migrate(db.engine)
    with db.session() as session:
        session.add(Tenant(id="tenant-1", name="t"))
        session.flush()
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        session.add(
            Job(
                id="job-1",
                tenant_id="tenant-1",
                job_name="j",
                status="running",
                spec={},
                run_dir=str(run_dir),
            )
        )
        session.commit()
    yield db
    db.engine.dispose()


def _answered(
    db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, progress: Any, events: Any
) -> Job:
    """The job after the scheduler took one poll answered with `progress` and `events`."""
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: refs)  # the poll's refs are the answers
    scheduler = Scheduler(Settings(data_dir=tmp_path / "data"), db)
    handle = DriverHandle(actor=object(), run_ref=object(), reattached=True, poll=[progress, events])
    with db.session() as session:
        job = session.scalars(select(Job)).one()
        assert scheduler._take_answer(session, job, handle) is False  # still running
        session.commit()
        session.refresh(job)
        session.expunge(job)
        return job


def _events(db: Database) -> list[tuple[str, str]]:
    with db.session() as session:
        return [(e.type, e.message) for e in session.scalars(select(JobEvent).order_by(JobEvent.id))]


def test_a_driver_of_an_earlier_build_answering_with_dicts_is_read_not_lost(
    database: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    progress = {
        "status": "running",
        "step": 2,
        "total_steps": 10,
        "metrics": {"reverse_kl": 0.25, "phase": "scoring", "lr": None, "loss": float("nan")},
        "eta_s": 40.0,
        "usage": {"wall_s": 12.5},
    }
    events = [
        {"seq": 0, "time": 1700000000.0, "type": "status", "message": "starting", "data": {}},
        {
            "seq": 1,
            "time": 1700000001.0,
            "type": "rollout_stats",
            "message": "a newer kind",
            "data": {"n": 4},
        },
    ]
    job = _answered(database, tmp_path, monkeypatch, progress, events)
    assert (job.step, job.total_steps, job.eta_s) == (2, 10, 40.0)
    assert job.metrics == {"reverse_kl": 0.25} and job.usage == {"wall_s": 12.5}  # numbers, finite
    assert job.driver_event_seq == 1
    assert _events(database) == [("status", "starting"), ("rollout_stats", "a newer kind")]


def test_this_builds_answer_is_read_the_same(
    database: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    progress = DriverProgress(status="running", step=1, total_steps=4, metrics={"reverse_kl": 0.5})
    events = [DriverEvent(seq=0, time=1700000000.0, type="step", message="step 1/4")]
    job = _answered(database, tmp_path, monkeypatch, progress, events)
    assert (job.step, job.total_steps, job.metrics) == (1, 4, {"reverse_kl": 0.5})
    assert _events(database) == [("step", "step 1/4")]


def test_a_lost_drivers_events_are_recovered_past_odd_lines(database: Database) -> None:
    """events.jsonl: an earlier incarnation's lines, then the lost driver's: one of a kind this build
    does not emit, one that is no event, and a last line half written. Neither the count taken at its
    start nor the recovery parses past what they need, and neither raises."""
    with database.session() as session:
        job = session.scalars(select(Job)).one()
        run = RunDir(job.run_dir)
        earlier = {"seq": 0, "time": 1.0, "type": "status", "message": "earlier incarnation", "data": {}}
        run.events_path.write_text(json.dumps(earlier) + "\n{not json\n")
        job.driver_events_offset = run.event_count()  # as `_start_driver` counts them
        job.driver_event_seq = 0  # the poll copied its first event
        lines = [
            {"seq": 0, "time": 2.0, "type": "status", "message": "copied by a poll", "data": {}},
            {"seq": 1, "time": 3.0, "type": "rollout_stats", "message": "a newer kind", "data": {}},
            {"seq": "two", "message": "no event"},
            {"seq": 3, "time": 4.0, "type": "error", "message": "ActorDiedError", "data": {}},
        ]
        with run.events_path.open("a") as out:
            out.write("".join(json.dumps(line) + "\n" for line in lines) + '{"seq": 4, "time": 5.0, "ty')
        Scheduler(Settings(data_dir=Path(job.run_dir) / "data"), database)._recover_events_from_disk(
            session, job
        )
        session.commit()
    assert _events(database) == [
        ("rollout_stats", "a newer kind"),
        ("recovery", "the driver stopped with an error: ActorDiedError"),
    ]
