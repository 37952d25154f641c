"""How the job server shares engines between jobs (teachers; LoRA jobs' students), and when a shared
group grows or shrinks.

Plain data and a pure policy, imported by the job server (which holds no vLLM) and by the registry
that applies them (`engine/shared_engines.py`).
"""

from __future__ import annotations

import dataclasses

BUSY_CHECKS_TO_GROW = 2
"""Consecutive load checks with requests waiting for a slot before a replica is added."""
IDLE_CHECKS_TO_SHRINK = 5
"""Consecutive load checks with nothing in flight or waiting before an added replica is removed."""


@dataclasses.dataclass(frozen=True)
class EngineSharing:
    """The server's sharing settings of one role: teachers (`OPD_SHARED_TEACHER_IDLE_S`,
    `OPD_SHARED_TEACHER_MAX_REPLICAS`) or LoRA jobs' students (`OPD_SHARED_STUDENT_IDLE_S`,
    `OPD_SHARED_STUDENT_MAX_JOBS`)."""

    idle_s: float
    """Seconds a group no job holds stays up before it is shut down."""
    max_replicas: int | None = None
    """Most replicas a group grows to under load; None: the first job's `resources.<role>.replicas`
    (a shared student never grows: a new replica would lack the jobs' adapters)."""
    max_jobs: int | None = None
    """Most jobs holding one group at once (a student engine holds one adapter per job: vLLM's
    `max_loras` is this plus one, for an update's swap); a job past it starts another group. None: any
    number (teachers)."""
    check_s: float = 2.0
    """Seconds between load checks (and checks that holders' drivers are alive)."""


@dataclasses.dataclass
class LoadStreak:
    """Consecutive busy / idle load checks of one group."""

    busy: int = 0
    idle: int = 0

    def scale(self, loads: list[dict[str, float]], replicas: int, low: int, high: int) -> int:
        """+1 to add a replica, -1 to remove one, 0 to stay, from each replica's `Engine.load`:
        grow after `BUSY_CHECKS_TO_GROW` checks in a row with requests waiting for a slot (below
        `high`), shrink after `IDLE_CHECKS_TO_SHRINK` with nothing in flight or waiting (above `low`)."""
        waiting = sum(load["queued"] for load in loads)
        working = sum(load["in_flight"] for load in loads) + waiting
        self.busy = self.busy + 1 if waiting > 0 else 0
        self.idle = self.idle + 1 if working == 0 else 0
        if self.busy >= BUSY_CHECKS_TO_GROW and replicas < high:
            self.busy = 0
            return 1
        if self.idle >= IDLE_CHECKS_TO_SHRINK and replicas > low:
            self.idle = 0
            return -1
        return 0
