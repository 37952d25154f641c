"""Events a lost driver left on disk: copied once, and its dying error kept as a `recovery` note.

A graceful stop of `opd serve` shuts its embedded Ray down under a running step; the driver can then
write `ActorDiedError` to its events.jsonl before it dies. The next server copies what the driver
wrote after the last poll and resumes the job, which then succeeds: the job's record must not carry
an error event it did not fail with. A real SQLite file and run directory; no Ray actor is involved.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from api.db import Database, migrate
from api.models import Job, JobEvent, Tenant
from api.services.scheduler import Scheduler
from api.settings import Settings
from opd_trainer.storage.run_dir import RunDir
from opd_trainer.wire.driver import DriverEvent


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Database]:
    db = Database(f"sqlite:///{tmp_path / 'opd.db'}")
    migrate(db.engine)
    yield db
    db.engine.dispose()


def test_a_lost_drivers_error_becomes_a_recovery_note(tmp_path: Path, database: Database) -> None:
    run_dir = RunDir(tmp_path / "runs" / "opdjob-1")
    run_dir.root.mkdir(parents=True)
    for seq, (kind, message) in enumerate(
        [
            ("step", "step 1/3"),  # polled before the stop
            ("step", "step 2/3"),  # written after the last poll
            ("error", "ActorDiedError: The actor died unexpectedly before finishing this task."),
        ]
    ):
        run_dir.event(DriverEvent(seq=seq, time=1.0 + seq, type=kind, message=message))
    scheduler = Scheduler(Settings(data_dir=tmp_path / "data"), database)
    with database.session() as session:
        session.add(Tenant(id="tenant-1", name="t"))
        session.flush()
        session.add(
            Job(
                id="opdjob-1",
                tenant_id="tenant-1",
                job_name="j",
                status="pausing",  # a lost driver of a pausing job leaves it paused: no Ray call
                spec={},
                run_dir=str(run_dir.root),
                driver_event_seq=0,
            )
        )
        session.commit()
        job = session.scalar(select(Job).where(Job.id == "opdjob-1"))
        assert job is not None
        scheduler._driver_lost(session, job, counts=False)
        session.commit()
        events = session.scalars(select(JobEvent).order_by(JobEvent.id)).all()
    kinds = [(e.type, e.message) for e in events]
    assert ("step", "step 2/3") in kinds and ("step", "step 1/3") not in kinds
    assert not [e for e in events if e.type == "error"]
    (note,) = [e for e in events if e.type == "recovery"]
    assert note.message.startswith("the driver stopped with an error: ActorDiedError")
    assert note.data["driver_error"].startswith("ActorDiedError")
    assert job.status == "paused"
