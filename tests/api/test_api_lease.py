"""The scheduler lease on a real SQLite file and a real PostgreSQL server: one holder at a time,
renewal, release, expiry, and takeover from a process of this host that is gone."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from api.db import Database, migrate
from api.services.lease import Lease, new_holder_id


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'opd.db'}"
    else:
        new_database: Callable[[], str] = request.getfixturevalue("postgres_databases")
        url = new_database()
    db = Database(url)
    migrate(db.engine)
    yield db
    db.engine.dispose()


def _pid_of_a_finished_process() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_one_holder_at_a_time_until_it_releases(database: Database) -> None:
    first, second = Lease(database, new_holder_id(), 60), Lease(database, new_holder_id(), 60)
    assert first.acquire() and first.acquire()  # taken, then renewed
    assert not second.acquire()
    assert first.current_holder() == first.holder
    first.release()
    assert first.current_holder() is None
    assert second.acquire() and not first.acquire()


def test_an_expired_lease_is_taken_over(database: Database) -> None:
    first, second = Lease(database, new_holder_id(), 0.5), Lease(database, new_holder_id(), 0.5)
    assert first.acquire() and not second.acquire()
    time.sleep(0.7)  # the holder stopped renewing
    assert second.acquire() and not first.acquire()


def test_a_holder_of_this_host_whose_process_is_gone_is_taken_over_at_once(database: Database) -> None:
    host = socket.gethostname()
    dead = Lease(database, f"{host}:{_pid_of_a_finished_process()}:crashed", 3600)
    assert dead.acquire()
    assert Lease(database, new_holder_id(), 60).acquire()


def test_a_live_holder_of_this_host_keeps_it(database: Database) -> None:
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as alive:
        try:
            holder = Lease(database, f"{socket.gethostname()}:{alive.pid}:running", 3600)
            assert holder.acquire()
            assert not Lease(database, new_holder_id(), 60).acquire()
        finally:
            alive.kill()
