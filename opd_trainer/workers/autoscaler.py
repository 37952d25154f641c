"""The autoscaling controller both worker pools (rollout and reward) use: pure logic, a clock, gauges.

A pool calls `Autoscaler.decide(PoolSnapshot(...))` on a timer and reconciles its live workers
towards `ScaleDecision.desired`: it starts `start` workers for an "up" decision (workers still
starting count as on their way, so a slow start is not asked for again every tick) and stops
`remove` idle workers for a "down" one. Nothing here starts or stops anything, so the rules are
testable with a fake clock and no Ray.

The rules (the product spec's runtime fields, `FunctionRuntime`):

* start at `capacity`; never leave `min_capacity`..`max_capacity`;
* utilisation = (in-flight + queued calls) / (workers × `concurrency`). Queued calls count because
  they are demand the pool is not serving: a saturated pool has in-flight = workers × concurrency,
  so in-flight alone never shows by how much it is short;
* utilisation above `concurrency_scale_threshold` scales up at once, straight to the workers the
  demand needs, `ceil(demand / (concurrency × threshold))`; worker memory use above
  `memory_scale_threshold` adds one worker; a pool at 0 workers with any demand gets at least one;
* utilisation that has stayed at or under the threshold (and memory under its threshold) for
  `scale_down_cooldown_s` removes idle workers down to the most workers the demand needed at any
  point of the last `scale_down_cooldown_s` (so one quiet tick at the end of the window does not
  remove workers that were busy a moment ago), never below `min_capacity`, and never a busy worker.

Every up/down decision is an `{"type": "autoscale", ...}` event and counted in `scale_events`; every
call of `decide` updates `gauges` (desired, current, in-flight, queued, utilisation). The pool reports
both with its step metrics and to the job server's poll (`pool.pool_metrics`), which exports them.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from opd_trainer.jobspec.job_spec import FunctionRuntime

logger = logging.getLogger(__name__)

ScaleAction = Literal["up", "down", "hold"]

# ceil() of a float ratio that is mathematically an integer (21 / (3 × 0.7) = 10) can land on
# 10.000000000000002 and ask for one worker too many; this tolerance absorbs that rounding.
_CEIL_TOLERANCE = 1e-9


@dataclass(frozen=True)
class AutoscalerSettings:
    """The pool-size rules of one processor component; `from_runtime` builds it from the job spec."""

    concurrency: int
    capacity: int
    min_capacity: int
    max_capacity: int
    concurrency_scale_threshold: float
    memory_scale_threshold: float
    scale_down_cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {self.concurrency}")
        if self.min_capacity < 0:
            raise ValueError(f"min_capacity: must be >= 0, got {self.min_capacity}")
        if self.max_capacity < 1:
            raise ValueError(f"max_capacity: must be >= 1, got {self.max_capacity}")
        if self.min_capacity > self.max_capacity:
            raise ValueError(
                f"min_capacity: must be <= max_capacity, got {self.min_capacity} > {self.max_capacity}"
            )
        if not self.min_capacity <= self.capacity <= self.max_capacity:
            raise ValueError(
                f"capacity: need min_capacity <= capacity <= max_capacity, got "
                f"{self.min_capacity} <= {self.capacity} <= {self.max_capacity}"
            )
        for name in ("concurrency_scale_threshold", "memory_scale_threshold"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name}: must be in (0, 1], got {value}")
        if self.scale_down_cooldown_s < 0:
            raise ValueError(f"scale_down_cooldown_s: must be >= 0, got {self.scale_down_cooldown_s}")

    @classmethod
    def from_runtime(
        cls, runtime: FunctionRuntime, *, scale_down_cooldown_s: float = 30.0
    ) -> AutoscalerSettings:
        """Takes the pool fields of a `FunctionRuntime` (or any object with the same attribute names)."""
        return cls(
            concurrency=runtime.concurrency,
            capacity=runtime.capacity,
            min_capacity=runtime.min_capacity,
            max_capacity=runtime.max_capacity,
            concurrency_scale_threshold=runtime.concurrency_scale_threshold,
            memory_scale_threshold=runtime.memory_scale_threshold,
            scale_down_cooldown_s=scale_down_cooldown_s,
        )

    def clamp(self, workers: int) -> int:
        return min(max(workers, self.min_capacity), self.max_capacity)

    def workers_needed(self, demand: int) -> int:
        """Fewest workers that keep `demand` calls at or under the threshold: ceil(d / (c × t)), uncapped."""
        if demand <= 0:
            return 0
        exact = demand / (self.concurrency * self.concurrency_scale_threshold)
        return math.ceil(exact - _CEIL_TOLERANCE)


@dataclass(frozen=True)
class PoolSnapshot:
    """What a pool reports to `Autoscaler.decide`: its live workers and the calls on them."""

    workers: int
    in_flight: int
    queued: int  # calls waiting for a free slot on some worker
    idle_workers: int  # workers with no call in flight: the only ones a scale-down may stop
    memory_fraction: float | None = None  # max over workers of used / limit; None when not measured
    starting: int = 0  # workers being started (not yet live): a scale-up counts them as on their way

    def __post_init__(self) -> None:
        for name in ("workers", "in_flight", "queued", "idle_workers", "starting"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.idle_workers > self.workers:
            raise ValueError(f"idle_workers: must be <= workers, got {self.idle_workers} > {self.workers}")


@dataclass(frozen=True)
class ScaleDecision:
    """The target pool size; for "up", `start` new workers (desired − current − those already
    starting); for "down", `remove` idle workers go (`remove` == current − desired)."""

    desired: int
    current: int
    action: ScaleAction
    reason: str
    utilisation: float  # math.inf for demand on a pool with 0 workers
    remove: int = 0
    start: int = 0


class Autoscaler:
    """Decides the size of one pool of one job from periodic `PoolSnapshot`s (see the module docstring)."""

    def __init__(
        self,
        settings: AutoscalerSettings,
        pool: str,
        job_id: str,
        clock: Callable[[], float] = time.monotonic,
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.job_id = job_id
        self._clock = clock
        self._on_event = on_event
        # What the last `decide` saw and wanted, and how many times it scaled each way.
        self.gauges: dict[str, float] = {}
        self.scale_events: dict[str, int] = {"up": 0, "down": 0}
        self._calm_since: float | None = None  # when utilisation last went from above to at/under
        self._needed: deque[tuple[float, int]] = deque()  # (time, workers needed) of the last cool-down

    def initial_workers(self) -> int:
        return self.settings.clamp(self.settings.capacity)

    def decide(self, snapshot: PoolSnapshot) -> ScaleDecision:
        s = self.settings
        now = self._clock()
        current = snapshot.workers
        demand = snapshot.in_flight + snapshot.queued
        slots = current * s.concurrency
        utilisation = demand / slots if slots else (math.inf if demand else 0.0)
        needed = s.workers_needed(demand)
        self._needed.append((now, needed))
        # A sample stands for the demand until the next one, so the window keeps the newest sample
        # taken at or before its start: demand seen at t=29 and replaced at t=30 still counts at t=59.
        while len(self._needed) > 1 and self._needed[1][0] <= now - s.scale_down_cooldown_s:
            self._needed.popleft()

        busy = utilisation > s.concurrency_scale_threshold
        memory_high = (
            snapshot.memory_fraction is not None and snapshot.memory_fraction > s.memory_scale_threshold
        )
        if busy or memory_high:
            self._calm_since = None
        elif self._calm_since is None:
            self._calm_since = now
        calm_for = 0.0 if self._calm_since is None else now - self._calm_since

        up_to, reasons = current, []
        if current < s.min_capacity:
            up_to = s.min_capacity
            reasons.append(f"{current} workers < min_capacity {s.min_capacity}")
        if busy:
            up_to = max(up_to, needed)
            reasons.append(
                f"utilisation {utilisation:.2f} > {s.concurrency_scale_threshold} "
                f"({demand} calls need {needed} workers)"
            )
        if memory_high:
            up_to = max(up_to, current + 1)
            reasons.append(f"memory {snapshot.memory_fraction:.2f} > {s.memory_scale_threshold}")
        up_to = min(up_to, s.max_capacity)

        if up_to > current + snapshot.starting:
            self._calm_since = None
            start = up_to - current - snapshot.starting
            decision = ScaleDecision(up_to, current, "up", "; ".join(reasons), utilisation, start=start)
        elif up_to > current:  # the workers already starting cover it: no new scale-up
            self._calm_since = None
            reasons.append(f"{snapshot.starting} starting")
            decision = ScaleDecision(up_to, current, "hold", "; ".join(reasons), utilisation)
        elif current > s.max_capacity:
            decision = self._remove_idle(
                snapshot, s.max_capacity, f"{current} workers > max_capacity {s.max_capacity}", utilisation
            )
        elif reasons:
            if current >= s.max_capacity:
                reasons.append(f"at max_capacity {s.max_capacity}")
            decision = ScaleDecision(current, current, "hold", "; ".join(reasons), utilisation)
        else:
            decision = self._scale_down_or_hold(snapshot, calm_for=calm_for, utilisation=utilisation)

        self._record(decision, snapshot)
        return decision

    def _scale_down_or_hold(
        self, snapshot: PoolSnapshot, calm_for: float, utilisation: float
    ) -> ScaleDecision:
        s, current = self.settings, snapshot.workers
        if calm_for < s.scale_down_cooldown_s:
            reason = f"cooling down ({calm_for:.1f} of {s.scale_down_cooldown_s:.1f} s at/under threshold)"
            return ScaleDecision(current, current, "hold", reason, utilisation)
        recent_peak = max(needed for _, needed in self._needed)
        target = s.clamp(recent_peak)
        if target >= current:
            return ScaleDecision(current, current, "hold", "workers match demand", utilisation)
        reason = (
            f"utilisation {utilisation:.2f} <= {s.concurrency_scale_threshold} for {calm_for:.1f} s; "
            f"peak demand of the last {s.scale_down_cooldown_s:.1f} s needs {recent_peak} workers"
        )
        return self._remove_idle(snapshot, target, reason, utilisation)

    @staticmethod
    def _remove_idle(snapshot: PoolSnapshot, target: int, reason: str, utilisation: float) -> ScaleDecision:
        current = snapshot.workers
        remove = min(current - target, snapshot.idle_workers)
        if remove <= 0:
            return ScaleDecision(current, current, "hold", f"{reason}; no idle worker to remove", utilisation)
        if current - remove > target:
            reason += f"; only {remove} idle"
        return ScaleDecision(current - remove, current, "down", reason, utilisation, remove=remove)

    def _record(self, decision: ScaleDecision, snapshot: PoolSnapshot) -> None:
        self.gauges = {
            "workers_desired": float(decision.desired),
            "workers_current": float(decision.current),
            "in_flight": float(snapshot.in_flight),
            "queued": float(snapshot.queued),
            "utilisation": decision.utilisation,
        }
        if decision.action == "hold":
            return
        self.scale_events[decision.action] += 1
        logger.info(
            "[%s] %s pool autoscale %s %d -> %d: %s",
            self.job_id,
            self.pool,
            decision.action,
            decision.current,
            decision.desired,
            decision.reason,
        )
        if self._on_event is not None:
            self._on_event(
                {
                    "type": "autoscale",
                    "pool": self.pool,
                    "job_id": self.job_id,
                    "action": decision.action,
                    "from": decision.current,
                    "to": decision.desired,
                    "reason": decision.reason,
                    "utilisation": decision.utilisation,
                }
            )
