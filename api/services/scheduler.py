"""The scheduler: starts one detached, named job-driver actor per running job and mirrors its progress.

It runs in its own thread and, every `poll_interval_s`:

1. asks each running driver for `progress()` and `events(after=last copied seq)` and copies the new
   events into the database in the same transaction that advances the cursor, so none is lost or
   copied twice; a driver that reports `succeeded`/`failed`/`stopped` moves its job to the matching
   status (`stopped` → `paused` or `cancelled`, whichever the user asked for) and is killed;
2. forwards pause/cancel requests to drivers (`request_stop()`: stop after this step, with a
   checkpoint); a job still `cancelling` `cancel_grace_s` after the user's request is cancelled by
   force: its driver is killed, and with it every actor the driver started (below);
3. starts queued jobs while fewer than `max_concurrent_jobs` hold a driver, fairly across tenants
   (`fair_queue`), at most `max_concurrent_jobs_per_tenant` of one tenant.

Nothing a driver does can hold this thread: calls to drivers are sent, then waited for at most
`ANSWER_WAIT_S` per poll all together, and an answer that has not come is looked for again at the next
poll; drivers are created on threads of their own. A driver that has not answered for
`driver_unresponsive_s` (its event loop blocked by a tracker or other synchronous code, its node
silent) counts as lost, like one that died.

What a job owns: the driver creates its engines, learner ranks, gateways and processor pool workers
(and their placement groups) itself, none of them detached, so Ray owns them through the driver and
ends them when the driver dies (an actor's fate is shared with its owner's); killing the driver
(`ray.kill`) ends the whole job, and each worker's own child processes with it.

Replicas: several API processes may share one database; only the holder of the scheduler lease
(`api.services.lease`, renewed every poll) does any of the above. The others serve requests and wait
(`role` "standby": Ray joined or started, nothing scheduled); when the holder stops renewing, one of them
takes over and reconciles as below. A holder that finds its lease taken steps down.

Recovery: on start (or takeover) it reconciles every job that should have a driver. A driver still alive
(`ray.get_actor("opd-job-<id>", namespace="opd")`, e.g. on a Ray cluster that outlived the server) is
re-attached; otherwise a new driver is started on the same run directory, which resumes from the
latest checkpoint. Events the lost driver wrote to `events.jsonl` after the last poll are copied from
there first. A driver that dies (or stops answering) while the server watches is restarted the same
way, at most `max_driver_restarts` times.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.db import Database, database_unavailable, ping
from api.errors import APIError
from api.models import Job, JobEvent
from api.services.jobs import add_event, compare_and_set, finite, resolve_for_driver, status_since
from api.services.lease import Lease, new_holder_id
from api.services.states import WITH_DRIVER
from api.settings import Settings
from opd_trainer.engine.engine_sharing import EngineSharing
from opd_trainer.errors import OPDError
from opd_trainer.storage.run_dir import RunDir
from opd_trainer.storage.shared import write_probe
from opd_trainer.wire.driver import DriverEvent, DriverProgress, DriverStatus, driver_events

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from opd_trainer.jobspec.job_spec import JobSpec

logger = logging.getLogger(__name__)

NAMESPACE = "opd"
# Ray colours actor names in re-raised errors; those codes are noise in a JSON API and in logs.
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
CALL_TIMEOUT_S = 30.0
# The longest one poll waits for the drivers' answers, all drivers together.
ANSWER_WAIT_S = 1.0
# How long a finished driver's run() may take to return (its engines shut down) before it is killed.
FINISH_WAIT_S = 30.0
RAY_CHECK_EVERY_S = 10.0
RAY_RETRY_S = 10.0


def actor_name(job_id: str) -> str:
    return f"opd-job-{job_id}"


@dataclass
class DriverHandle:
    """One driver incarnation as the scheduler sees it."""

    actor: ActorHandle | None = None  # None while `launch` runs
    run_ref: ObjectRef | None = None  # None when re-attached: the previous server process held it
    launch: Future[tuple[ActorHandle, ObjectRef]] | None = None  # (actor, run_ref), from `Scheduler._launch`
    reattached: bool = False
    stop_sent: bool = False
    poll: list[ObjectRef] | None = None  # [request_stop?, progress, events] refs in flight
    answered: bool = False
    answered_at: float = field(default_factory=time.monotonic)  # or started, until it answers
    cancel_deadline: float | None = None  # wall-clock time past which a cancelling job is killed
    retire_by: float = 0.0  # retired: when to kill it even if run() has not returned

    def launched(self) -> bool:
        """Whether the actor exists (taking it from a finished launch); False while launching or if
        the launch failed (`launch.exception()`)."""
        if self.actor is None and self.launch is not None and self.launch_failure() is None:
            self.actor, self.run_ref = self.launch.result()
        return self.actor is not None

    def launch_failure(self) -> BaseException | None:
        """Why the launch failed, once it has (None while it runs or when it succeeded)."""
        if self.launch is None or not self.launch.done():
            return None
        return self.launch.exception()


def fair_queue(session: Session, free: int, per_tenant: int) -> list[str]:
    """Up to `free` queued job ids to start now, taken round-robin across tenants: each next one from
    the tenant with the fewest jobs holding a driver (then the one whose next job waited longest), and
    none from a tenant that already holds `per_tenant`. So neither one tenant's many queued jobs nor
    its jobs stuck running keep another tenant's next job from the next free slot."""
    if free <= 0:
        return []
    holding: Counter[str] = Counter()
    rows = session.execute(
        select(Job.tenant_id, func.count()).where(Job.status.in_(WITH_DRIVER)).group_by(Job.tenant_id)
    )
    for tenant, count in rows:
        holding[tenant] = count
    waiting: dict[str, deque[tuple[float, int, str]]] = {}
    queued = session.execute(
        select(Job.tenant_id, Job.queued_at, Job.pk, Job.id)
        .where(Job.status == "queued")
        .order_by(Job.queued_at, Job.pk)
    )
    for tenant, queued_at, pk, job_id in queued:
        waiting.setdefault(tenant, deque()).append((queued_at, pk, job_id))
    picked: list[str] = []
    while len(picked) < free:
        tenants = [t for t, jobs in waiting.items() if jobs and holding[t] < per_tenant]
        if not tenants:
            break
        tenant = min(tenants, key=lambda t: (holding[t], waiting[t][0][:2]))
        picked.append(waiting[tenant].popleft()[2])
        holding[tenant] += 1
    return picked


class Scheduler:
    """Owns the Ray side of the server; `ray_status` feeds `/readyz`."""

    def __init__(self, settings: Settings, db: Database) -> None:
        self.settings = settings
        self.db = db
        self.ray_status = "starting"
        self.lease = Lease(db, new_holder_id(), settings.scheduler_lease_s)
        self.role = "starting"  # "leader" while holding the lease, else "standby"
        self._ray_started = False
        self._next_ray_attempt = 0.0
        self._handles: dict[str, DriverHandle] = {}
        # Drivers no job holds any more, killed once launched (and, finished ones, once run() returned).
        self._retired: list[DriverHandle] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_ray_check = 0.0
        self._database_down_since: float | None = None  # monotonic; None while the database answers

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="opd-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops polling; drivers are detached and keep running for the next server to re-attach, and
        the lease is released so that another replica takes over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=CALL_TIMEOUT_S)
        if self.role == "leader":
            with contextlib.suppress(Exception):
                self.lease.release()

    @property
    def ready(self) -> bool:
        """A standby replica is ready to serve requests; the leader once Ray answers."""
        return self.role == "standby" or self.ray_status == "ok"

    def _main(self) -> None:
        while not self._stop.is_set():
            try:
                if self._database_down_since is not None:
                    self._database_back()
                self._step()
            except Exception as exc:
                if database_unavailable(exc):
                    self._database_down(exc)
                else:
                    logger.exception("scheduler step failed")
            self._stop.wait(self.settings.poll_interval_s)

    def _database_down(self, exc: Exception) -> None:
        """A poll the database did not answer (PostgreSQL restarting, failing over): what it had changed
        was rolled back (`tick`) and the next poll tries again. The drivers train on meanwhile; their
        events wait in their event lists until a poll copies them, and no job changes status."""
        if self._database_down_since is None:
            self._database_down_since = time.monotonic()
            reason = (str(exc).strip().splitlines() or [""])[0]
            logger.warning(
                "database unavailable (%s: %s); the scheduler tries again every %gs, jobs keep running",
                type(exc).__name__,
                reason,
                self.settings.poll_interval_s,
            )

    def _database_back(self) -> None:
        """Ends an outage once the database answers (raises while it does not). Drivers were not
        polled during it, so that time does not count towards `driver_unresponsive_s`."""
        assert self._database_down_since is not None
        ping(self.db.engine)
        outage = time.monotonic() - self._database_down_since
        self._database_down_since = None
        for handle in self._handles.values():
            handle.answered_at += outage
        logger.warning("database reachable again after %.0fs: scheduling goes on", outage)

    def _step(self) -> None:
        """One poll: Ray up (every replica: `opd serve` starts it before the app), the lease held (or
        waited for), then scheduling as its holder."""
        if not self._ray_started and time.monotonic() >= self._next_ray_attempt:
            self._start_ray()
        if self._ray_started and self._retired:
            self._kill_retired()
        if not self.lease.acquire():
            if self.role == "leader":
                self._step_down()
            if self.role != "standby":
                logger.info("scheduler standby: another server holds the lease")
            self.role = "standby"
            return
        if not self._ray_started:
            return
        if self.role != "leader":
            self.role = "leader"
            logger.info("scheduler lease taken: reconciling jobs")
            try:
                self.reconcile()
            except Exception:
                logger.exception("reconciling jobs after start failed")
        self.tick()

    def _start_ray(self) -> None:
        # Lazy: the server module loads without Ray; Ray loads when the scheduler thread uses it.
        from opd_trainer.cluster.ray_runtime import init_ray

        try:
            # An embedded Ray must not outlive this server, however it dies.
            init_ray(self.settings.ray_address, reap_on_exit=True)
        except Exception as exc:  # keep the API up and retry: the cluster may come later
            self.ray_status = f"error: {type(exc).__name__}: {exc}"
            logger.exception("cannot start or join Ray; retrying in %.0fs", RAY_RETRY_S)
            self._next_ray_attempt = time.monotonic() + RAY_RETRY_S
            return
        self._ray_started = True
        self.ray_status = "ok"

    def _step_down(self) -> None:
        """Another replica took the lease (this one failed to renew in time): stop driving jobs. On an
        embedded Ray our drivers are unreachable to the new holder, so they are stopped rather than
        left to run twice; on a shared cluster the new holder re-attaches to them."""
        # Lazy: the server module loads without Ray; Ray loads when the scheduler thread uses it.
        from opd_trainer.cluster.ray_runtime import embedded_ray

        logger.warning("scheduler lease lost to %s: stepping down", self.lease.current_holder())
        handles, self._handles = self._handles, {}
        if embedded_ray(self.settings.ray_address):
            for handle in handles.values():
                self._retire(handle)

    # -- recovery -------------------------------------------------------------------------------

    def reconcile(self) -> None:
        """Re-attach to live drivers of unfinished jobs, or resume them from their checkpoints.

        A re-attached driver is polled like any other: one that turns out dead is replaced without
        counting as a restart, one that does not answer counts as lost after `driver_unresponsive_s`."""
        # Lazy: the server module loads without Ray; Ray loads when the scheduler thread uses it.
        import ray

        with self.db.session() as session:
            stale = session.scalars(select(Job).where(Job.status == "validating_files")).all()
            for job in stale:
                # Pre-flight runs inside the submit request: its client never got an answer.
                error = {"code": "preflight_interrupted", "message": "server stopped during pre-flight"}
                compare_and_set(session, job.id, "validating_files", "failed", error=error)
            jobs = session.scalars(select(Job).where(Job.status.in_(WITH_DRIVER)).order_by(Job.pk)).all()
            for job in jobs:
                try:
                    actor = ray.get_actor(actor_name(job.id), namespace=NAMESPACE)
                except ValueError:
                    actor = None
                if actor is None:
                    add_event(
                        session, job.id, "recovery", "server restarted; driver gone, resuming from checkpoint"
                    )
                    self._driver_lost(session, job, counts=False)
                else:
                    self._handles[job.id] = DriverHandle(actor, reattached=True)
                    add_event(
                        session, job.id, "recovery", "server restarted; re-attached to the running driver"
                    )
                session.commit()
            logger.info("reconciled %d unfinished jobs", len(jobs))

    def _recover_events_from_disk(self, session: Session, job: Job) -> None:
        """Copies what a lost driver wrote to events.jsonl after our last poll (shared run dirs only).

        An `error` among them is what the driver saw while it was dying (e.g. `ActorDiedError` when a
        graceful stop of the server shuts its embedded Ray down under a running step), not the job's
        error: the job goes on from its checkpoint or fails as `driver_lost`. It is kept, as a
        `recovery` event that says so, so a job that then succeeds carries no error event.
        """
        written = RunDir(job.run_dir).events(job.driver_events_offset)
        lost = [event for event in written if event.seq > job.driver_event_seq]
        self._ingest(session, job, [_recovery_note(e) if e.type == "error" else e for e in lost])

    def _driver_lost(self, session: Session, job: Job, *, counts: bool) -> None:
        handle = self._handles.pop(job.id, None)
        if handle is not None:
            self._retire(handle)
        self._recover_events_from_disk(session, job)
        if job.status == "pausing":
            self._move(session, job, "paused", "driver gone; paused at its latest checkpoint")
        elif job.status == "cancelling":
            self._move(session, job, "cancelled", "driver gone; cancelled")
        elif counts and job.driver_restarts >= self.settings.max_driver_restarts:
            error = {
                "code": "driver_lost",
                "message": f"the job driver died {job.driver_restarts + 1} times",
                "param": None,
            }
            self._move(session, job, "failed", "driver died too often", error=error)
        else:
            if counts:
                job.driver_restarts += 1
                add_event(session, job.id, "recovery", "driver died; restarting from the latest checkpoint")
            self._start_driver(session, job)

    def _retire(self, handle: DriverHandle, wait_s: float = 0.0) -> None:
        """Kills `handle`'s driver, and with it every actor the driver started: now, or once its
        launch has finished; with `wait_s`, once its `run()` has returned or `wait_s` has passed."""
        handle.retire_by = time.monotonic() + wait_s
        self._retired.append(handle)
        self._kill_retired()

    def _kill_retired(self) -> None:
        # Lazy: the server module loads without Ray; Ray loads when the scheduler thread uses it.
        import ray

        waiting = []
        for handle in self._retired:
            if handle.launch is not None and not handle.launch.done():
                waiting.append(handle)
                continue
            if not handle.launched():
                continue  # its launch failed: no actor
            if handle.run_ref is not None:
                if time.monotonic() < handle.retire_by and not ray.wait([handle.run_ref], timeout=0)[0]:
                    waiting.append(handle)
                    continue
                # Collect run()'s result, so Ray does not log an error nobody retrieved.
                with contextlib.suppress(Exception):
                    ray.get(handle.run_ref, timeout=0)
            with contextlib.suppress(Exception):
                ray.kill(handle.actor)  # detached: it lives until killed
        self._retired = waiting

    # -- one poll -------------------------------------------------------------------------------

    def tick(self) -> None:
        self._check_ray()
        self._kill_retired()
        with self.db.session() as session:
            jobs = session.scalars(select(Job).where(Job.status.in_(WITH_DRIVER)).order_by(Job.pk)).all()
            answered = self._ask(jobs)
            for job in jobs:
                held = self._handles.get(job.id)
                try:
                    self._poll(session, job, answered)
                    session.commit()
                except Exception as exc:
                    session.rollback()
                    if database_unavailable(exc):
                        # The rest of this poll would fail alike; the next one asks the drivers again
                        # from the cursors the database kept, so no event is lost or copied twice.
                        self._forget_uncommitted(job.id, held)
                        raise
                    logger.exception("[%s] polling the driver failed", job.id)
            self._start_queued(session)

    def _forget_uncommitted(self, job_id: str, held: DriverHandle | None) -> None:
        """After a database error undid what a poll or start did to `job_id`: a driver started in it
        (`held` is the handle before) has no record in the database (its attempt, its event cursor), so
        it is stopped again; the next poll finds the job without a driver and starts one the usual way
        (`_driver_lost`, its events recovered from the run dir)."""
        handle = self._handles.get(job_id)
        if handle is not None and handle is not held:
            del self._handles[job_id]
            self._retire(handle)

    def _check_ray(self) -> None:
        # Lazy: the server module loads without Ray; Ray loads when the scheduler thread uses it.
        import ray

        if time.monotonic() - self._last_ray_check < RAY_CHECK_EVERY_S:
            return
        self._last_ray_check = time.monotonic()
        try:
            alive = sum(1 for node in ray.nodes() if node.get("Alive"))
            self.ray_status = "ok" if alive else "error: no live Ray node"
        except Exception as exc:
            self.ray_status = f"error: {type(exc).__name__}"

    def _ask(self, jobs: list[Job]) -> set[ObjectRef]:
        """Sends every driver with no call in flight its poll (first a stop request, once, if the user
        asked to pause or cancel), then waits at most `ANSWER_WAIT_S` for every driver's answer
        together; returns the refs answered. An answer still missing is looked for at the next poll."""
        # Lazy: the server module loads without Ray; Ray loads when the scheduler thread uses it.
        import ray

        in_flight: list[ObjectRef] = []
        for job in jobs:
            handle = self._handles.get(job.id)
            if handle is None or not handle.launched():
                continue
            if handle.poll is None:
                calls = []
                if job.status in ("pausing", "cancelling") and not handle.stop_sent:
                    calls.append(handle.actor.request_stop.remote())
                    handle.stop_sent = True
                calls += [handle.actor.progress.remote(), handle.actor.events.remote(job.driver_event_seq)]
                handle.poll = calls
            in_flight += handle.poll
        if not in_flight:
            return set()
        ready, _ = ray.wait(in_flight, num_returns=len(in_flight), timeout=ANSWER_WAIT_S)
        return set(ready)

    def _poll(self, session: Session, job: Job, answered: set[ObjectRef]) -> None:
        handle = self._handles.get(job.id)
        if handle is None:
            # A job put in a driver status by someone else (another server): treat as lost.
            self._driver_lost(session, job, counts=False)
            return
        failure = handle.launch_failure()
        if failure is not None:
            logger.error("[%s] starting the driver failed", job.id, exc_info=failure)
            add_event(
                session, job.id, "recovery", f"the job driver could not be started ({type(failure).__name__})"
            )
            self._driver_lost(session, job, counts=True)
            return
        answer = handle.poll is not None and all(ref in answered for ref in handle.poll)
        if answer and self._take_answer(session, job, handle):
            return
        if job.status == "cancelling" and self._past_cancel_bound(session, job, handle):
            self._force_cancel(session, job, handle)
            return
        silent = time.monotonic() - handle.answered_at
        if silent > self.settings.driver_unresponsive_s:
            since = "answered no poll" if handle.answered else "has not answered since it was started"
            logger.warning("[%s] driver %s for %.0fs: lost", job.id, since, silent)
            add_event(
                session,
                job.id,
                "recovery",
                f"the job driver {since} for {silent:.0f}s (limit {self.settings.driver_unresponsive_s:g}s): "
                "counted as lost",
                {"unresponsive_s": round(silent, 1)},
            )
            self._driver_lost(session, job, counts=True)

    def _take_answer(self, session: Session, job: Job, handle: DriverHandle) -> bool:
        """Applies a driver's answered poll; True when the job no longer has this driver."""
        # Lazy: the server module loads without Ray; Ray loads when the scheduler thread uses it.
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        assert handle.actor is not None and handle.poll is not None  # answered: launched and polled
        refs, handle.poll = handle.poll, None
        try:
            *_, answered_progress, answered_events = ray.get(refs, timeout=ANSWER_WAIT_S)
        except (GetTimeoutError, ActorUnavailableError):
            logger.warning("[%s] driver unavailable; asking again", job.id)
            return False
        except RayActorError as exc:
            logger.warning("[%s] driver died: %s", job.id, exc)
            # A re-attached driver found dead is the server's restart, not the job's failure.
            self._driver_lost(session, job, counts=handle.answered or not handle.reattached)
            return True
        handle.answered, handle.answered_at = True, time.monotonic()
        # A driver of an earlier build (started before an upgrade, re-attached) answers with dicts.
        progress = DriverProgress.model_validate(answered_progress)
        self._ingest(session, job, driver_events(answered_events, f"[{job.id}] driver"))
        previous_step = job.step
        job.step = progress.step
        job.total_steps = progress.total_steps or job.total_steps  # 0 until it read the data
        job.eta_s = finite(progress.eta_s)
        metrics = _finite_values(progress.metrics)
        if metrics:
            job.metrics = metrics
        usage = _finite_values(progress.usage)
        if usage:
            job.usage = usage
        if job.step != previous_step:
            job.trained_tokens = self._trained_tokens(job, metrics, job.step - previous_step)
        if progress.status == "created" and handle.run_ref is None:
            handle.run_ref = handle.actor.run.remote()  # the previous server died between create and run
        if progress.status in ("succeeded", "failed", "stopped"):
            self._finish(session, job, handle, progress.status)
            return True
        return False

    def _past_cancel_bound(self, session: Session, job: Job, handle: DriverHandle) -> bool:
        """Whether `cancel_grace_s` has passed since the user asked to cancel (or, with no record of
        the request, since this scheduler first saw the job cancelling)."""
        if handle.cancel_deadline is None:
            asked = status_since(session, job.id, "cancelling") or time.time()
            handle.cancel_deadline = asked + self.settings.cancel_grace_s
        return time.time() >= handle.cancel_deadline

    def _force_cancel(self, session: Session, job: Job, handle: DriverHandle) -> None:
        """Cancels a job whose driver did not stop in time: whatever user code or a step is waiting
        for, the driver is killed, its engines, learner ranks, gateways and pool workers with it."""
        grace = self.settings.cancel_grace_s
        logger.warning("[%s] driver did not stop within %gs of the cancel request: killing it", job.id, grace)
        self._handles.pop(job.id, None)
        self._retire(handle)
        self._recover_events_from_disk(session, job)
        why = (
            f"the driver did not stop within {grace:g}s of the cancel request; it and every actor it "
            "started were killed"
        )
        self._move(session, job, "cancelled", why, event_data={"forced": True, "cancel_grace_s": grace})

    def _trained_tokens(self, job: Job, metrics: dict[str, float], new_steps: int) -> float:
        records = finite(RunDir(job.run_dir).records())
        if records:
            return float(sum(r.get("trained_tokens") or 0 for r in records if r.get("kind") == "train"))
        # Run dir not visible from here (a remote cluster): estimate from the latest step.
        return job.trained_tokens + max(new_steps, 0) * float(metrics.get("trained_tokens", 0.0))

    def _ingest(self, session: Session, job: Job, events: list[DriverEvent]) -> None:
        for event in sorted(events, key=lambda e: e.seq):
            message = ANSI_ESCAPE.sub("", event.message)
            add_event(session, job.id, event.type, message, finite(event.data), at=event.time)
            job.driver_event_seq = event.seq

    def _finish(self, session: Session, job: Job, handle: DriverHandle, driver_status: DriverStatus) -> None:
        error = None
        if driver_status == "succeeded":
            new = "succeeded"
        elif driver_status == "failed":
            new = "failed"
            error = self._failure(session, job, handle)
        else:
            new = {"cancelling": "cancelled"}.get(job.status, "paused")
        self._move(session, job, new, f"driver {driver_status}", error=error)
        self._handles.pop(job.id, None)
        # Its run() returns once it has shut the job's engines and pools down; then it is killed.
        self._retire(handle, FINISH_WAIT_S)

    def _failure(self, session: Session, job: Job, handle: DriverHandle) -> dict[str, str | None]:
        last = session.scalar(
            select(JobEvent)
            .where(JobEvent.job_id == job.id, JobEvent.type == "error")
            .order_by(JobEvent.id.desc())
        )
        if last is not None:
            return {"code": "job_failed", "message": last.message, "param": last.data.get("field")}
        message = "the job driver failed"
        if handle.run_ref is not None:
            # Lazy: the server module loads without Ray; Ray loads when the scheduler thread uses it.
            import ray

            try:
                ray.get(handle.run_ref, timeout=ANSWER_WAIT_S)
            except OPDError as exc:  # Ray re-raises the driver's error as a subclass of it
                return {"code": "job_failed", "message": exc.message, "param": exc.field}
            except Exception as exc:
                message = ANSI_ESCAPE.sub("", f"{type(exc).__name__}: {str(exc)[:2000]}")
        return {"code": "job_failed", "message": message, "param": None}

    def _move(
        self,
        session: Session,
        job: Job,
        new: str,
        why: str,
        *,
        event_data: dict[str, Any] | None = None,
        **fields: Any,
    ) -> None:
        """Moves the job to `new` from whatever it is now (the user may have just paused it); its
        status event carries `event_data` besides the status."""
        for _ in range(3):
            current = session.scalar(select(Job.status).where(Job.id == job.id))
            if current is None or current == new:
                return
            if compare_and_set(session, job.id, current, new, **fields):
                data = {**(event_data or {}), "status": new}
                add_event(session, job.id, "status", f"{current} -> {new}: {why}", data)
                session.flush()
                session.refresh(job)
                return
        logger.warning("[%s] could not move to %s", job.id, new)

    # -- starting -------------------------------------------------------------------------------

    def _start_queued(self, session: Session) -> None:
        if self.ray_status != "ok":
            return
        holding = (
            session.scalar(select(func.count()).select_from(Job).where(Job.status.in_(WITH_DRIVER))) or 0
        )
        free = self.settings.max_concurrent_jobs - holding
        for job_id in fair_queue(session, free, self.settings.tenant_slots):
            try:
                if not compare_and_set(session, job_id, "queued", "running", started_at=int(time.time())):
                    continue
                job = session.scalars(select(Job).where(Job.id == job_id)).one()
                session.refresh(job)
                why = "queued -> running: starting the job driver"
                add_event(session, job.id, "status", why, {"status": "running"})
                self._start_driver(session, job)
                session.commit()
            except Exception as exc:
                if database_unavailable(exc):  # the job stays queued: no driver for it
                    session.rollback()
                    self._forget_uncommitted(job_id, None)
                raise

    def _start_driver(self, session: Session, job: Job) -> None:
        """A new driver incarnation on the job's run dir (it resumes from the latest checkpoint),
        created on a thread of its own (`_launch`); the polls pick it up once it exists."""
        try:
            spec = resolve_for_driver(session, job)
        except (APIError, OPDError) as exc:
            param = exc.param if isinstance(exc, APIError) else exc.field
            error = {"code": "file_missing", "message": exc.message, "param": param}
            self._move(session, job, "failed", "its files are gone", error=error)
            return
        if spec.resources.max_recoveries is None:  # the server's default (`driver/recovery.py`)
            resources = spec.resources.model_copy(update={"max_recoveries": self.settings.max_recoveries})
            spec = spec.model_copy(update={"resources": resources})
        # Counted before the new driver can write: what follows in events.jsonl is its own.
        job.driver_events_offset = RunDir(job.run_dir).event_count()
        storage_token = write_probe(Path(job.run_dir))  # the driver and learner check they see it
        launch = self._launch(spec, job.run_dir, job.id, storage_token, self._sharing())
        self._handles[job.id] = DriverHandle(launch=launch)
        job.driver_attempts += 1
        job.driver_event_seq = -1
        logger.info(
            "[%s] starting driver %s (incarnation %d)", job.id, actor_name(job.id), job.driver_attempts
        )

    def _sharing(self) -> tuple[EngineSharing | None, EngineSharing | None]:
        """The drivers' `EngineSharing` of teachers and of LoRA jobs' students from the settings; None
        where sharing is off."""
        settings = self.settings
        teachers = students = None
        if settings.shared_teacher_idle_s is not None:
            teachers = EngineSharing(settings.shared_teacher_idle_s, settings.shared_teacher_max_replicas)
        if settings.shared_student_idle_s is not None:
            students = EngineSharing(
                settings.shared_student_idle_s, max_jobs=settings.shared_student_max_jobs
            )
        return teachers, students

    @classmethod
    def _launch(
        cls,
        spec: JobSpec,
        run_dir: str,
        job_id: str,
        storage_token: str,
        sharing: tuple[EngineSharing | None, EngineSharing | None],
    ) -> Future[tuple[ActorHandle, ObjectRef]]:
        """The driver actor and its `run()` under way, made on a thread of its own: creating it waits
        for a Ray task that imports the training stack on the cluster (this process may not hold it:
        the api image), and this thread must not. A daemon thread, so that a launch Ray cannot place
        never holds the server's exit."""
        # Lazy: the server module loads without Ray; Ray loads when the scheduler thread uses it.
        from opd_trainer.driver.launch import launch_driver

        made: Future[tuple[ActorHandle, ObjectRef]] = Future()

        def launch() -> None:
            try:
                name = actor_name(job_id)
                cls._kill_named(name)
                actor = launch_driver(spec, run_dir, job_id, storage_token, name, NAMESPACE, *sharing)
                made.set_result((actor, actor.run.remote()))
            except BaseException as exc:
                made.set_exception(exc)

        threading.Thread(target=launch, name=f"opd-launch-{job_id}", daemon=True).start()
        return made

    @staticmethod
    def _kill_named(name: str) -> None:
        """Removes a leftover actor of a previous incarnation, and waits until its name is free."""
        # Lazy: the server module loads without Ray; Ray loads when the scheduler thread uses it.
        import ray

        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:
            return
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                return
            time.sleep(0.2)


def _finite_values(values: dict[str, float]) -> dict[str, float]:
    """`values` without its NaN and infinite entries: JSON responses and PostgreSQL reject them."""
    return {k: v for k, v in values.items() if math.isfinite(v)}


def _recovery_note(error: DriverEvent) -> DriverEvent:
    """A lost driver's `error` event as a `recovery` note: what it saw while dying, not the job's error."""
    return error.model_copy(
        update={
            "type": "recovery",
            "message": f"the driver stopped with an error: {error.message}",
            "data": {**error.data, "driver_error": error.message},
        }
    )
