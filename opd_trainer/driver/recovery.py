"""Recovering a job from a lost component: what counts as one, who died, the budget and the history.

A component lost mid-job (an engine replica, the gateway host, a learner rank, a node holding any of
them: the actor's process killed, its node gone) fails whatever the step was waiting for with one of
Ray's death errors (`death_error`), or, seen from the user's rollout code, with failed requests. Either
way the driver then asks every actor it holds whether it is alive (`probe`); when one is dead or the
error is a death, it stops what is left, starts the job's parts again and resumes from the latest
checkpoint (`JobDriver.run`). Pool workers are not probed: their pools replace them in place.

`RecoveryLog` keeps the history in the run directory (`recoveries.jsonl`), so the budget
(`resources.max_recoveries`) and the repeat rule hold across driver incarnations too (the server starts
a new driver when the driver itself dies): the same components lost at the same step twice fail the job
with the cause instead of looping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from pathlib import Path

from ray.actor import ActorHandle
from ray.exceptions import (
    ActorUnavailableError,
    GetTimeoutError,
    NodeDiedError,
    ObjectLostError,
    OutOfMemoryError,
    RayActorError,
    WorkerCrashedError,
)

from opd_trainer.errors import exception_chain
from opd_trainer.wire.driver import RecoveryRecord

DEFAULT_MAX_RECOVERIES = 3
"""`resources.max_recoveries` when the job gives none and no server default applies (`opd train`)."""

DEATH_ERRORS = (RayActorError, NodeDiedError, WorkerCrashedError, ObjectLostError, OutOfMemoryError)
PROBE_TIMEOUT_S = 15.0  # an actor that answers nothing in this time is busy, not counted as dead
UNAVAILABLE_S = 30.0  # an actor Ray calls unavailable this long is counted as lost
RECOVERIES_FILE = "recoveries.jsonl"


def death_error(exc: BaseException) -> BaseException | None:
    """The first of Ray's death errors in `exc`'s chain (`errors.exception_chain`); None when none."""
    return next((found for found in exception_chain(exc) if isinstance(found, DEATH_ERRORS)), None)


@dataclasses.dataclass(frozen=True)
class Lost:
    """One dead actor: what it was for the job, where it ran and why Ray says it died."""

    name: str  # e.g. "student engine replica 0", "learner rank 1"
    where: str  # "ip 10.0.0.3 pid 1234", or "" when Ray did not say
    why: str  # Ray's reason, one sentence ("it was killed by `ray.kill`")

    def describe(self) -> str:
        return f"{self.name} ({', '.join(part for part in (self.where, self.why) if part)})"


def _death_details(error: BaseException) -> tuple[str, str]:
    text = str(error)
    ip, pid = re.search(r"\bip: (\S+)", text), re.search(r"\bpid: (\d+)", text)
    where = " ".join(part for part in (ip and f"ip {ip[1]}", pid and f"pid {pid[1]}") if part)
    reason = re.search(r"The actor is dead because (.+?)(?:\.\s|\.$|$)", text)
    if reason is not None:
        return where, reason[1].strip()
    if isinstance(error, NodeDiedError) or ("node" in text.lower() and "died" in text.lower()):
        return where, "its node died"
    return where, type(error).__name__


async def probe(
    actors: dict[str, ActorHandle], timeout_s: float = PROBE_TIMEOUT_S, unavailable_s: float = UNAVAILABLE_S
) -> list[Lost]:
    """The actors of `actors` (by what they are for the job) that Ray reports dead. Ray's own
    readiness call answers from any live actor, even one whose methods are all busy; one that does not
    answer within `timeout_s` is not counted (a live actor on a slow node). One Ray calls unavailable
    (its node unreachable: a lost node looks like this first) counts once it has been so for
    `unavailable_s`, or once Ray says it died."""

    async def check(name: str, actor: ActorHandle) -> Lost | None:
        deadline = time.monotonic() + unavailable_s
        while True:
            try:
                await asyncio.wait_for(actor.__ray_ready__.remote(), timeout_s)
            except ActorUnavailableError:  # "may be available later": dead only if it stays so
                if time.monotonic() >= deadline:
                    return Lost(name, "", f"unreachable for {unavailable_s:g}s (its node gone or cut off)")
                await asyncio.sleep(1.0)
                continue
            except DEATH_ERRORS as error:
                return Lost(name, *_death_details(error))
            except (TimeoutError, GetTimeoutError):
                return None
            return None

    found = await asyncio.gather(*(check(name, actor) for name, actor in actors.items()))
    return [lost for lost in found if lost is not None]


def cause_of(lost: list[Lost], error: BaseException | None) -> str:
    """What failed, as the repeat rule compares it: the dead components' names, else the error's
    type (a death of something not probed, e.g. a pool worker's task)."""
    if lost:
        return ", ".join(sorted(item.name for item in lost))
    return type(error).__name__ if error is not None else "unknown"


class RecoveryLog:
    """The job's recoveries so far, one JSON line each in the run directory."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / RECOVERIES_FILE

    def entries(self) -> list[RecoveryRecord]:
        if not self.path.is_file():
            return []
        found = []
        for line in self.path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # a line half-written when the process died
                continue
            if isinstance(entry, dict):
                found.append(RecoveryRecord.model_validate(entry))
        return found

    def refusal(self, step: int, cause: str, budget: int) -> str | None:
        """Why the job must not recover again (its budget spent, or the same failure at the same step
        already recovered from once); None when it may."""
        entries = self.entries()
        if len(entries) >= budget:
            return (
                f"{len(entries)} recoveries already (resources.max_recoveries={budget}); the job fails "
                "instead of recovering again"
            )
        if any(e.step == step and e.cause == cause for e in entries):
            return (
                f"the same failure ({cause}) at the same step ({step + 1}) a second time: it would repeat, "
                "so the job fails instead of recovering again"
            )
        return None

    def add(self, step: int, cause: str, message: str, resumes_from: int | None) -> int:
        """Records one recovery; returns how many the job has had."""
        entry = RecoveryRecord(
            time=time.time(), step=step, cause=cause, message=message, resumes_from=resumes_from
        )
        torn = self.path.is_file() and not self.path.read_bytes().endswith(b"\n")
        with self.path.open("a") as out:  # after a line half-written when a process died, a new line
            out.write(("\n" if torn else "") + json.dumps(entry.model_dump()) + "\n")
        return len(self.entries())
