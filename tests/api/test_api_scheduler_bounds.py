"""The scheduler's bounds against drivers that do not cooperate: real Ray, a real SQLite file.

A stand-in driver (a Ray actor with the job driver's polling interface, `progress`, `events`,
`request_stop`) owns an actor and a placement group the way a real driver owns its engines and its
learner ranks' gang. Against it:

- a cancelled job whose driver does not stop (its step waits on something that never comes, or its
  event loop is blocked) is `cancelled` within `cancel_grace_s` of the request, by force, and what the
  driver owned is gone with it;
- a driver that stops when asked ends its job `cancelled` the ordinary way, not by force;
- a driver that stops answering counts as lost, and no poll holds the scheduler thread past
  `ANSWER_WAIT_S`;
- a driver that outlived its server is re-attached without a call that could hang, and started if
  the server died before starting it.

The real driver, stuck in a real job, is in `test_api_cancel_bound.py`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group_table
from sqlalchemy import select

from api.db import Database, migrate
from api.models import Job, JobEvent, Tenant
from api.services.jobs import add_event
from api.services.scheduler import ANSWER_WAIT_S, NAMESPACE, DriverHandle, Scheduler, actor_name
from api.settings import Settings
from opd_trainer.cluster.ray_runtime import init_ray, shutdown_ray
from opd_trainer.wire.driver import DriverEvent, DriverProgress

GRACE_S = 3.0
# A poll's own time on top of the bound: one poll interval, one answer wait, and the tick's work.
SLACK_S = 0.2 + ANSWER_WAIT_S + 1.5


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    init_ray()
    yield
    shutdown_ray()


@pytest.fixture
def database(ray_session: None, tmp_path: Path) -> Iterator[Database]:
    db = Database(f"sqlite:///{tmp_path / 'opd.db'}")
    migrate(db.engine)
    yield db
    db.engine.dispose()
    Scheduler._kill_named(actor_name("job-1"))  # a detached stand-in a failed test left behind


def stand_in_driver(mode: str) -> Any:
    """A driver actor in `mode`: "stuck" is asked to stop but never does (its step never ends),
    "obeys" stops when asked, "hung" answers its first poll and then nothing (a blocked event loop),
    "created" was created by a server that died before it called `run()`.
    Defined here, not at module level, so Ray ships the classes by value to its workers."""

    @ray.remote(num_cpus=0)
    class Owned:
        def ping(self) -> str:
            return "pong"

    @ray.remote(num_cpus=0)
    class StandInDriver:
        def __init__(self, mode: str) -> None:
            from ray.util.placement_group import placement_group

            self.mode = mode
            self.polls = 0
            self.stop_requested = False
            self.ran = False
            self.owned = Owned.remote()
            self.group = placement_group([{"CPU": 0.01}])
            self.started = time.time()

        def parts(self) -> tuple[Any, str]:
            return self.owned, self.group.id.hex()

        def run(self) -> str:
            self.ran = True
            return "ran"

        def request_stop(self) -> None:
            self.stop_requested = True

        def progress(self) -> DriverProgress:
            self.polls += 1
            if self.mode == "hung" and self.polls > 1:
                time.sleep(3600)
            if self.mode == "created" and not self.ran:
                status = "created"
            else:
                status = "stopped" if self.stop_requested and self.mode == "obeys" else "running"
            return DriverProgress(status=status, step=0, total_steps=3)

        def events(self, after: int) -> list[DriverEvent]:
            events = [DriverEvent(seq=0, time=self.started, type="status", message="starting")]
            if self.stop_requested:
                events.append(DriverEvent(seq=1, time=self.started, type="status", message="stop asked"))
            return [e for e in events if e.seq > after]

    # Detached and named like the real driver (`launch_driver`): what a detached actor creates goes
    # with it, its placement groups included (those of an actor with an owner outlive it).
    return StandInDriver.options(name=actor_name("job-1"), namespace=NAMESPACE, lifetime="detached").remote(
        mode
    )


def submitted(db: Database, tmp_path: Path, status: str) -> str:
    """A job of a new tenant in `status`; a cancelling one with the user's request just recorded."""
    with db.session() as session:
        session.add(Tenant(id="tenant-1", name="t"))
        session.flush()
        session.add(
            Job(id="job-1", tenant_id="tenant-1", job_name="j", status=status, spec={}, run_dir=str(tmp_path))
        )
        if status == "cancelling":
            add_event(
                session, "job-1", "status", "cancel requested: running -> cancelling", {"status": status}
            )
        session.commit()
    return "job-1"


def tick_until(scheduler: Scheduler, db: Database, done: set[str], limit_s: float) -> tuple[Job, list[float]]:
    """Ticks like the scheduler thread (every 0.2 s) until the job is in `done`; each tick's time."""
    took: list[float] = []
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        started = time.monotonic()
        scheduler.tick()
        took.append(time.monotonic() - started)
        with db.session() as session:
            job = session.scalars(select(Job)).one()
            if job.status in done:
                return job, took
        time.sleep(0.2)
    raise AssertionError(f"job still {job.status} after {limit_s}s")


def assert_dies(method: Any, limit_s: float = 60) -> None:
    """Calls the actor `method` until the actor is dead (Ray ends an owned actor a moment after its owner)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            ray.get(method.remote(), timeout=limit_s)
        except RayActorError:
            return
        time.sleep(0.5)
    raise AssertionError(f"{method} still answers after {limit_s}s")


def events_of(db: Database) -> list[JobEvent]:
    with db.session() as session:
        return list(session.scalars(select(JobEvent).order_by(JobEvent.id)))


@pytest.mark.parametrize("mode", ["stuck", "hung"])
def test_a_cancel_the_driver_does_not_honour_is_forced_within_the_bound(
    ray_session: None, database: Database, tmp_path: Path, mode: str
) -> None:
    settings = Settings(data_dir=tmp_path / "data", cancel_grace_s=GRACE_S, driver_unresponsive_s=600)
    scheduler = Scheduler(settings, database)
    driver = stand_in_driver(mode)
    owned, group = ray.get(driver.parts.remote())
    job_id = submitted(database, tmp_path, "running")
    scheduler._handles[job_id] = DriverHandle(driver)
    tick_until(scheduler, database, {"running"}, 10)  # one poll, answered (the hung driver's only one)
    with database.session() as session:
        job = session.scalars(select(Job)).one()
        job.status = "cancelling"
        add_event(
            session, job_id, "status", "cancel requested: running -> cancelling", {"status": "cancelling"}
        )
        session.commit()
    asked = time.time()

    job, took = tick_until(scheduler, database, {"cancelled"}, GRACE_S + 30)
    assert job.finished_at is not None
    assert GRACE_S <= time.time() - asked <= GRACE_S + SLACK_S
    assert max(took) <= ANSWER_WAIT_S + 1.0, took
    (final,) = [e for e in events_of(database) if e.data.get("status") == "cancelled"]
    assert final.data["forced"] is True and "did not stop within 3s" in final.message
    messages = [e.message for e in events_of(database)]
    if mode == "stuck":  # it was asked first, and said so
        assert "stop asked" in messages
    # What the driver owned went with it: its actor, and its placement group.
    assert_dies(owned.ping)
    deadline = time.monotonic() + 60
    while placement_group_table().get(group, {}).get("state") != "REMOVED":
        assert time.monotonic() < deadline, placement_group_table().get(group)
        time.sleep(0.5)


def test_a_driver_that_stops_when_asked_is_cancelled_without_force(
    ray_session: None, database: Database, tmp_path: Path
) -> None:
    scheduler = Scheduler(Settings(data_dir=tmp_path / "data", cancel_grace_s=GRACE_S), database)
    job_id = submitted(database, tmp_path, "cancelling")
    driver = stand_in_driver("obeys")
    scheduler._handles[job_id] = DriverHandle(driver)
    tick_until(scheduler, database, {"cancelled"}, 30)
    (final,) = [e for e in events_of(database) if e.data.get("status") == "cancelled"]
    assert "forced" not in final.data and final.message.endswith("driver stopped")
    assert "stop asked" in [e.message for e in events_of(database)]


def test_a_driver_that_stops_answering_is_lost_and_never_holds_the_scheduler(
    ray_session: None, database: Database, tmp_path: Path
) -> None:
    unresponsive_s = 4.0
    settings = Settings(
        data_dir=tmp_path / "data",
        driver_unresponsive_s=unresponsive_s,
        max_driver_restarts=0,
        poll_interval_s=0.2,
    )
    scheduler = Scheduler(settings, database)
    job_id = submitted(database, tmp_path, "running")
    driver = stand_in_driver("hung")
    scheduler._handles[job_id] = DriverHandle(driver)
    started = time.monotonic()
    job, took = tick_until(scheduler, database, {"failed"}, unresponsive_s + 30)
    assert unresponsive_s <= time.monotonic() - started <= unresponsive_s + SLACK_S + 1
    assert max(took) <= ANSWER_WAIT_S + 1.0, took
    assert job.error is not None and job.error["code"] == "driver_lost"
    (lost,) = [e for e in events_of(database) if e.type == "recovery"]
    assert lost.message.startswith("the job driver answered no poll for")
    assert_dies(driver.parts)  # killed, not left blocked


def test_a_driver_that_outlived_its_server_is_re_attached_and_started_if_it_never_ran(
    database: Database, tmp_path: Path
) -> None:
    job_id = submitted(database, tmp_path, "running")
    driver = stand_in_driver("created")
    scheduler = Scheduler(Settings(data_dir=tmp_path / "data"), database)
    scheduler.reconcile()
    handle = scheduler._handles[job_id]
    assert handle.reattached and handle.run_ref is None
    deadline = time.monotonic() + 30
    while handle.run_ref is None:
        assert time.monotonic() < deadline, "the re-attached driver was never started"
        scheduler.tick()
        time.sleep(0.2)
    assert ray.get(handle.run_ref, timeout=30) == "ran"
    assert ray.get(driver.progress.remote(), timeout=30).status == "running"
    with database.session() as session:
        job = session.scalars(select(Job)).one()
        assert job.status == "running" and job.driver_restarts == 0 and job.driver_attempts == 0
    assert "server restarted; re-attached to the running driver" in [e.message for e in events_of(database)]
