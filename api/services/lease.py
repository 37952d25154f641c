"""The scheduler lease: a row in the database that names the one server process allowed to schedule.

Every replica of the API serves requests; only the lease holder starts, polls and stops job drivers.
Each step is one conditional `UPDATE` (atomic on SQLite and PostgreSQL alike): take the row if it is
ours, expired, released, or held by a process of this host that no longer exists (a crashed server
restarted on the same machine need not wait for the lease to run out).

A database outage (PostgreSQL restarted) stops every replica's renewals alike, so the lease may run out
while nobody could renew it. A replica that could not reach the database therefore leaves another
holder's lapsed lease alone for one more `ttl_s` after it reaches it again: a live holder renews in that
time and keeps its jobs (a takeover on an embedded Ray would stop and resume them all), while a holder
that died during the outage is still replaced, `ttl_s` later than otherwise.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

import psutil
from sqlalchemy import or_, update
from sqlalchemy.exc import IntegrityError

from api.db import Database, database_unavailable
from api.models import SchedulerLease

LEASE_NAME = "scheduler"


def new_holder_id() -> str:
    """`host:pid:nonce`: unique per process, and tells whether a holder on this host is still alive."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _gone_from_this_host(holder: str) -> bool:
    host, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    return not psutil.pid_exists(int(pid))


class Lease:
    def __init__(self, db: Database, holder: str, ttl_s: float) -> None:
        self.db = db
        self.holder = holder
        self.ttl_s = ttl_s
        self._unreachable = False  # the last try could not reach the database
        self._patient_until = 0.0  # till then another holder's lapsed lease is left to it (above)

    def acquire(self) -> bool:
        """Takes or renews the lease; False while another live process holds it (or may still renew
        it after a database outage). Raises what the database raised when it cannot be reached."""
        try:
            taken = self._acquire()
        except Exception as exc:
            if database_unavailable(exc):
                self._unreachable = True
            raise
        if self._unreachable:
            self._unreachable = False
            self._patient_until = time.time() + self.ttl_s
        return taken

    def _acquire(self) -> bool:
        now = time.time()
        with self.db.session() as session:
            current = session.get(SchedulerLease, LEASE_NAME)
            if current is None:
                session.add(SchedulerLease(name=LEASE_NAME, holder=self.holder, expires_at=now + self.ttl_s))
                try:
                    session.commit()
                    return True
                except IntegrityError:  # another replica inserted it first
                    session.rollback()
                    return False
            takeable = [SchedulerLease.holder == self.holder]
            if now >= self._patient_until and not self._unreachable:
                takeable.append(SchedulerLease.expires_at < now)
            if _gone_from_this_host(current.holder):
                takeable.append(SchedulerLease.holder == current.holder)
            result = session.execute(
                update(SchedulerLease)
                .where(SchedulerLease.name == LEASE_NAME, or_(*takeable))
                .values(holder=self.holder, expires_at=now + self.ttl_s)
                .execution_options(synchronize_session=False)
            )
            session.commit()
            return bool(result.rowcount)  # type: ignore[attr-defined]

    def release(self) -> None:
        """Lets another replica take over at once (a graceful stop)."""
        with self.db.session() as session:
            session.execute(
                update(SchedulerLease)
                .where(SchedulerLease.name == LEASE_NAME, SchedulerLease.holder == self.holder)
                .values(expires_at=0.0)
                .execution_options(synchronize_session=False)
            )
            session.commit()

    def current_holder(self) -> str | None:
        with self.db.session() as session:
            row = session.get(SchedulerLease, LEASE_NAME)
            return row.holder if row is not None and row.expires_at >= time.time() else None
