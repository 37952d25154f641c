"""Autoscaler rules (`workers.autoscaler`) on hand-computed pools, with a fake clock.

Unless a test says otherwise: concurrency 10, both thresholds 0.8 (so one worker carries 8 calls
before the pool scales up), capacity 2, min 1, max 8, cool-down 30 s.
"""

from __future__ import annotations

import math
import pickle
from typing import Any

import pytest

from opd_trainer.jobspec.job_spec import FunctionRuntime
from opd_trainer.workers.autoscaler import Autoscaler, AutoscalerSettings, PoolSnapshot, ScaleDecision

BASE = {
    "concurrency": 10,
    "capacity": 2,
    "min_capacity": 1,
    "max_capacity": 8,
    "concurrency_scale_threshold": 0.8,
    "memory_scale_threshold": 0.8,
    "scale_down_cooldown_s": 30.0,
}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """One autoscaler with its clock and event list."""

    def __init__(self, **overrides: Any) -> None:
        self.clock = FakeClock()
        self.events: list[dict[str, Any]] = []
        self.scaler = Autoscaler(
            AutoscalerSettings(**{**BASE, **overrides}),
            pool="rollout",
            job_id="job-1",
            clock=self.clock,
            on_event=self.events.append,
        )

    def at(
        self,
        t: float,
        workers: int,
        in_flight: int,
        queued: int = 0,
        idle: int = 0,
        memory: float | None = None,
        starting: int = 0,
    ) -> ScaleDecision:
        self.clock.now = t
        return self.scaler.decide(PoolSnapshot(workers, in_flight, queued, idle, memory, starting))


# --- settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"min_capacity": 3}, "capacity"),  # min 3 > capacity 2
        ({"capacity": 9}, "capacity"),  # capacity 9 > max 8
        ({"min_capacity": 9, "capacity": 9}, "min_capacity"),  # min 9 > max 8
        ({"min_capacity": -1}, "min_capacity"),
        ({"max_capacity": 0, "capacity": 0, "min_capacity": 0}, "max_capacity"),
        ({"concurrency": 0}, "concurrency"),
        ({"concurrency_scale_threshold": 0.0}, "concurrency_scale_threshold"),
        ({"concurrency_scale_threshold": 1.01}, "concurrency_scale_threshold"),
        ({"memory_scale_threshold": 0.0}, "memory_scale_threshold"),
        ({"memory_scale_threshold": 1.5}, "memory_scale_threshold"),
        ({"scale_down_cooldown_s": -1.0}, "scale_down_cooldown_s"),
    ],
)
def test_invalid_settings_raise_value_error_naming_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: "):
        AutoscalerSettings(**{**BASE, **overrides})


def test_thresholds_of_exactly_one_are_valid() -> None:
    settings = AutoscalerSettings(
        **{**BASE, "concurrency_scale_threshold": 1.0, "memory_scale_threshold": 1.0}
    )
    assert settings.workers_needed(20) == 2


def test_from_runtime_copies_the_pool_fields() -> None:
    runtime = FunctionRuntime(
        concurrency=4,
        capacity=3,
        min_capacity=2,
        max_capacity=6,
        concurrency_scale_threshold=0.5,
        memory_scale_threshold=0.9,
    )
    settings = AutoscalerSettings.from_runtime(runtime, scale_down_cooldown_s=12.0)
    assert settings == AutoscalerSettings(
        concurrency=4,
        capacity=3,
        min_capacity=2,
        max_capacity=6,
        concurrency_scale_threshold=0.5,
        memory_scale_threshold=0.9,
        scale_down_cooldown_s=12.0,
    )
    assert AutoscalerSettings.from_runtime(runtime).scale_down_cooldown_s == 30.0


def test_workers_needed_is_ceil_of_demand_over_concurrency_times_threshold() -> None:
    settings = AutoscalerSettings(**BASE)  # 8 calls per worker
    assert [settings.workers_needed(d) for d in (0, 1, 8, 9, 16, 17, 50)] == [0, 1, 1, 2, 2, 3, 7]
    # 21 / (3 × 0.7) is 10.000000000000002 in floats; 10 workers carry exactly 0.7 each.
    odd = AutoscalerSettings(**{**BASE, "concurrency": 3, "concurrency_scale_threshold": 0.7})
    assert odd.workers_needed(21) == 10
    assert odd.workers_needed(22) == 11


# --- start and scale-up -------------------------------------------------------------------------


def test_initial_workers_is_capacity() -> None:
    assert Harness().scaler.initial_workers() == 2
    assert Harness(capacity=0, min_capacity=0).scaler.initial_workers() == 0
    assert Harness(capacity=8).scaler.initial_workers() == 8


def test_burst_scales_straight_to_the_needed_count() -> None:
    h = Harness()
    # 50 calls on 2 × 10 slots: utilisation 2.5; ceil(50 / 8) = 7 workers.
    decision = h.at(0, workers=2, in_flight=20, queued=30)
    assert decision == ScaleDecision(
        desired=7, current=2, action="up", reason=decision.reason, utilisation=2.5, remove=0, start=5
    )
    assert "utilisation 2.50 > 0.8" in decision.reason


def test_burst_caps_at_max_capacity_then_holds() -> None:
    h = Harness()
    # 100 calls need ceil(100 / 8) = 13 workers; max is 8.
    assert h.at(0, workers=2, in_flight=20, queued=80).desired == 8
    held = h.at(1, workers=8, in_flight=80, queued=20)
    assert (held.action, held.desired) == ("hold", 8)
    assert "at max_capacity 8" in held.reason


def test_utilisation_exactly_at_threshold_holds() -> None:
    decision = Harness().at(0, workers=2, in_flight=16, idle=0)  # 16 / 20 = 0.8, not above
    assert (decision.action, decision.desired, decision.utilisation) == ("hold", 2, 0.8)
    assert "cooling down" in decision.reason  # at the threshold counts as calm, not as pressure


def test_queued_calls_count_as_demand() -> None:
    h = Harness()
    # One saturated-looking worker: 8 in flight alone is 0.8 (hold) ...
    assert h.at(0, workers=1, in_flight=8).action == "hold"
    # ... but 12 more waiting make 20 calls: utilisation 2.0, ceil(20 / 8) = 3 workers.
    decision = h.at(1, workers=1, in_flight=8, queued=12)
    assert (decision.action, decision.desired, decision.utilisation) == ("up", 3, 2.0)


def test_memory_pressure_adds_one_worker() -> None:
    h = Harness()
    decision = h.at(0, workers=2, in_flight=2, memory=0.9)  # utilisation 0.1, memory 0.9 > 0.8
    assert (decision.action, decision.desired) == ("up", 3)
    assert "memory 0.90 > 0.8" in decision.reason
    assert h.at(1, workers=3, in_flight=2, memory=0.8).action == "hold"  # not above
    assert h.at(2, workers=3, in_flight=2, memory=None).action == "hold"  # unknown


def test_memory_pressure_at_max_capacity_holds() -> None:
    decision = Harness().at(0, workers=8, in_flight=2, memory=0.95)
    assert (decision.action, decision.desired) == ("hold", 8)


def test_memory_and_demand_together_take_the_larger_target() -> None:
    # 30 calls need ceil(30 / 8) = 4 workers, memory alone would give 3.
    decision = Harness().at(0, workers=2, in_flight=20, queued=10, memory=0.9)
    assert (decision.action, decision.desired) == ("up", 4)


def test_zero_workers_with_demand_scale_to_one() -> None:
    h = Harness(capacity=0, min_capacity=0)
    idle = h.at(0, workers=0, in_flight=0)
    assert (idle.action, idle.desired, idle.utilisation) == ("hold", 0, 0.0)
    decision = h.at(1, workers=0, in_flight=0, queued=1)
    assert (decision.action, decision.desired) == ("up", 1)
    assert decision.utilisation == math.inf


def test_below_min_capacity_scales_up_to_min() -> None:
    # A worker died: 1 live worker under min 3, no load.
    decision = Harness(capacity=3, min_capacity=3).at(0, workers=1, in_flight=0, idle=1)
    assert (decision.action, decision.desired) == ("up", 3)


# --- scale-down ---------------------------------------------------------------------------------


def test_no_scale_down_before_cooldown_then_down_to_needed() -> None:
    h = Harness()
    # 4 workers, 4 calls all on one worker: utilisation 0.1, needs ceil(4 / 8) = 1 worker.
    first = h.at(0, workers=4, in_flight=4, idle=3)
    assert (first.action, first.desired) == ("hold", 4)
    assert "cooling down" in first.reason
    assert h.at(29.9, workers=4, in_flight=4, idle=3).action == "hold"
    decision = h.at(30, workers=4, in_flight=4, idle=3)
    assert decision == ScaleDecision(
        desired=1, current=4, action="down", reason=decision.reason, utilisation=0.1, remove=3
    )


def test_scale_down_removes_only_idle_workers() -> None:
    h = Harness()
    h.at(0, workers=4, in_flight=4, idle=2)  # calls spread over 2 workers
    decision = h.at(30, workers=4, in_flight=4, idle=2)
    assert (decision.action, decision.desired, decision.remove) == ("down", 2, 2)
    assert "only 2 idle" in decision.reason
    # Later a busy worker finishes: the next tick removes it too, with no new cool-down.
    later = h.at(31, workers=2, in_flight=4, idle=1)
    assert (later.action, later.desired, later.remove) == ("down", 1, 1)


def test_scale_down_with_no_idle_worker_holds() -> None:
    h = Harness()
    h.at(0, workers=4, in_flight=4, idle=0)
    decision = h.at(30, workers=4, in_flight=4, idle=0)
    assert (decision.action, decision.desired, decision.remove) == ("hold", 4, 0)
    assert "no idle worker" in decision.reason


def test_scale_down_never_goes_below_min_capacity() -> None:
    h = Harness(capacity=2, min_capacity=2)
    h.at(0, workers=5, in_flight=0, idle=5)
    decision = h.at(30, workers=5, in_flight=0, idle=5)
    assert (decision.action, decision.desired, decision.remove) == ("down", 2, 3)
    assert h.at(60, workers=2, in_flight=0, idle=2).action == "hold"


def test_scale_to_zero_when_min_capacity_is_zero() -> None:
    h = Harness(capacity=1, min_capacity=0)
    h.at(0, workers=2, in_flight=0, idle=2)
    decision = h.at(30, workers=2, in_flight=0, idle=2)
    assert (decision.action, decision.desired, decision.remove) == ("down", 0, 2)


def test_cooldown_timer_resets_when_load_comes_back() -> None:
    h = Harness()
    h.at(0, workers=8, in_flight=4, idle=7)  # calm from t=0
    # At max capacity, load above the threshold cannot scale up, but it restarts the cool-down.
    busy = h.at(10, workers=8, in_flight=70, idle=0)  # 70 / 80 = 0.875
    assert (busy.action, busy.desired) == ("hold", 8)
    h.at(11, workers=8, in_flight=4, idle=7)  # calm again from t=11
    held = h.at(35, workers=8, in_flight=4, idle=7)  # 35 s after t=0 but 24 s after t=11
    assert held.action == "hold"
    assert "cooling down (24.0 of 30.0 s" in held.reason
    assert h.at(41, workers=8, in_flight=4, idle=7).desired == 1


def test_cooldown_timer_resets_on_scale_up() -> None:
    h = Harness()
    h.at(0, workers=4, in_flight=4, idle=3)  # calm from t=0
    assert h.at(20, workers=4, in_flight=33).desired == 5  # ceil(33 / 8) = 5
    h.at(25, workers=5, in_flight=4, idle=4)  # calm from t=25
    assert h.at(50, workers=5, in_flight=4, idle=4).action == "hold"
    decision = h.at(55, workers=5, in_flight=4, idle=4)
    assert (decision.action, decision.desired) == ("down", 1)


def test_scale_down_keeps_the_peak_demand_of_the_cooldown_window() -> None:
    h = Harness()
    h.at(0, workers=5, in_flight=30, idle=1)  # 30 / 50 = 0.6: calm, but needs ceil(30 / 8) = 4
    h.at(29, workers=5, in_flight=30, idle=1)
    # Demand drops to 2 at the end of the window: the 4 workers needed a moment ago stay.
    decision = h.at(30, workers=5, in_flight=2, idle=3)
    assert (decision.action, decision.desired, decision.remove) == ("down", 4, 1)
    # Once the busy samples are older than 30 s, the pool shrinks to what 2 calls need.
    # A sample holds until the next one: the 30 calls seen at t=29 stood until t=30.
    assert h.at(59.5, workers=4, in_flight=2, idle=3).desired == 4
    assert h.at(60, workers=4, in_flight=2, idle=3).desired == 1


# --- events and metrics -------------------------------------------------------------------------


def test_events_for_up_and_down_and_none_for_hold() -> None:
    h = Harness()
    up = h.at(0, workers=2, in_flight=20, queued=30)
    h.at(1, workers=7, in_flight=4, idle=6)
    assert len(h.events) == 1  # the hold (cooling down) added nothing
    down = h.at(31, workers=7, in_flight=4, idle=6)
    assert h.events == [
        {
            "type": "autoscale",
            "pool": "rollout",
            "job_id": "job-1",
            "action": "up",
            "from": 2,
            "to": 7,
            "reason": up.reason,
            "utilisation": 2.5,
        },
        {
            "type": "autoscale",
            "pool": "rollout",
            "job_id": "job-1",
            "action": "down",
            "from": 7,
            "to": 1,
            "reason": down.reason,
            "utilisation": pytest.approx(4 / 70),
        },
    ]


def test_gauges_and_counts_follow_each_decision() -> None:
    h = Harness()
    h.at(0, workers=2, in_flight=20, queued=30)
    assert h.scaler.gauges == {
        "workers_desired": 7,
        "workers_current": 2,
        "in_flight": 20,
        "queued": 30,
        "utilisation": 2.5,
    }
    assert h.scaler.scale_events == {"up": 1, "down": 0}

    h.at(1, workers=7, in_flight=14, idle=0)  # hold: gauges move, counts do not
    assert h.scaler.gauges["workers_current"] == 7 and h.scaler.gauges["in_flight"] == 14
    assert h.scaler.gauges["utilisation"] == 0.2
    assert h.scaler.scale_events == {"up": 1, "down": 0}


def test_each_autoscaler_keeps_its_own_numbers() -> None:
    h = Harness()
    other = Autoscaler(AutoscalerSettings(**BASE), pool="reward", job_id="job-1")
    h.at(0, workers=2, in_flight=20, queued=30)
    other.decide(PoolSnapshot(workers=2, in_flight=1, queued=0, idle_workers=1))
    assert h.scaler.gauges["workers_desired"] == 7 and other.gauges["workers_desired"] == 2
    assert other.scale_events == {"up": 0, "down": 0}


def test_snapshot_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError, match=r"^idle_workers: "):
        PoolSnapshot(workers=1, in_flight=0, queued=0, idle_workers=2)
    with pytest.raises(ValueError, match=r"^queued: "):
        PoolSnapshot(workers=1, in_flight=0, queued=-1, idle_workers=0)


def test_settings_snapshot_and_decision_survive_pickle() -> None:
    # Pools are Ray actors: settings travel to them, snapshots and decisions may travel back.
    items = [
        AutoscalerSettings(**BASE),
        PoolSnapshot(workers=2, in_flight=3, queued=1, idle_workers=0, memory_fraction=0.5),
        ScaleDecision(desired=3, current=2, action="up", reason="r", utilisation=1.5),
    ]
    for item in items:
        assert pickle.loads(pickle.dumps(item)) == item


def test_workers_still_starting_are_not_asked_for_again() -> None:
    """A replacement that takes seconds to start (a lost node, a slow setup) is one scale-up, not
    one per tick: the ticks while it starts hold, and only demand beyond it starts more."""
    h = Harness(min_capacity=1, capacity=1, max_capacity=4, concurrency=1, concurrency_scale_threshold=1.0)
    first = h.at(0.0, workers=0, in_flight=0, queued=1)
    assert (first.action, first.start) == ("up", 1)
    for t in (1.0, 2.0, 3.0):
        held = h.at(t, workers=0, in_flight=0, queued=1, starting=1)
        assert held.action == "hold" and held.desired == 1 and "1 starting" in held.reason
    more = h.at(4.0, workers=0, in_flight=0, queued=3, starting=1)
    assert (more.action, more.desired, more.start) == ("up", 3, 2)
    assert h.scaler.scale_events["up"] == 2 and len(h.events) == 2
