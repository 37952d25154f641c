"""The step's pure phases (`driver/step.py`): the step clock, the shape phase's staleness filter
(`signal/staleness.py`), and mini-batches of whole rollouts. The sample and score phases run with fakes
in `test_scoring_per_rollout.py` and `test_teacher_hindsight.py`; the whole step in the integration
jobs."""

from __future__ import annotations

import collections

import pytest

from opd_trainer.driver import step as step_module
from opd_trainer.driver.step import StepClock, minibatches
from opd_trainer.records import LLMCall
from opd_trainer.signal.staleness import drop_stale


def _segment(rollout_id: int, version: int = 0) -> LLMCall:
    return LLMCall([1], [2, 3], [-0.1, -0.2], weight_version=version, rollout_id=rollout_id)


def test_the_step_clock_runs_from_one_lap_to_the_next_leaving_out_only_what_is_excluded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(step_module.time, "perf_counter", lambda: now[0])
    clock = StepClock()
    now[0] += 2.0  # the first step
    assert clock.lap() == 2.0
    now[0] += 0.5  # that step's records and events, after its lap: counted in the next step
    with clock.excluded():
        now[0] += 7.0  # a validation between the steps
    now[0] += 3.0  # the second step
    assert clock.lap() == pytest.approx(3.5)
    now[0] += 1.0
    assert clock.lap() == pytest.approx(1.0)  # nothing excluded any more


def test_segments_staler_than_max_staleness_are_dropped_and_counted() -> None:
    segments = [_segment(0, version=5), _segment(1, version=4), _segment(2, version=2)]
    shaped = drop_stale(segments, 5, max_staleness=1)
    assert [s.rollout_id for s in shaped.segments] == [0, 1]
    assert shaped.metrics["staleness/dropped_segments"] == 1.0 and shaped.metrics["staleness/max"] == 3.0
    assert shaped.metrics["staleness/mean"] == pytest.approx(4 / 3)
    shaped = drop_stale(segments, 5, max_staleness=0)
    assert len(shaped.segments) == 3  # on-policy: nothing to drop
    assert shaped.metrics["staleness/dropped_segments"] == 0.0


def test_minibatches_hold_whole_rollouts() -> None:
    segments = [_segment(0), _segment(1), _segment(1), _segment(2), _segment(3), _segment(3)]
    batches = minibatches(segments, 2)
    assert [[s.rollout_id for s in batch] for batch in batches] == [[0, 1, 1], [2, 3, 3]]
    assert minibatches([], 2) == []


def test_kept_segments_carry_their_staleness_for_the_learner() -> None:
    segments = [_segment(0, version=5), _segment(1, version=4), _segment(2, version=3)]
    shaped = drop_stale(segments, 5, max_staleness=2)
    assert [s.staleness for s in shaped.segments] == [0, 1, 2]


class _QueuedSampler(step_module.Sampler):
    """A `Sampler` whose batches are placeholders: what it starts, and in which order, is the test."""

    def __init__(self) -> None:
        self.ahead = collections.deque()
        self.started: list[int] = []
        self.position = 0

    def start(self, step: int) -> step_module.Batch:
        self.started.append(step)
        cursor = {"position": self.position}
        self.position += 1
        return step_module.Batch(step, cursor, None, None)  # type: ignore[arg-type]


def test_the_sampler_keeps_up_to_max_staleness_batches_ahead_oldest_first() -> None:
    sampler = _QueuedSampler()
    first = sampler.take(0)  # nothing ahead: started now
    assert first.step == 0 and sampler.started == [0]
    sampler.sample_ahead(0, 2)  # max_staleness 2: steps 1 and 2 start while step 0 learns
    assert [b.step for b in sampler.ahead] == [1, 2]
    assert sampler.cursor_state() == {"position": 1}  # a checkpoint resumes before the first of them
    assert sampler.take(1).step == 1
    sampler.sample_ahead(1, 3)  # only step 3 is new
    sampler.sample_ahead(1, 3)  # and asking again starts nothing
    assert sampler.started == [0, 1, 2, 3] and [b.step for b in sampler.ahead] == [2, 3]
    sampler.sample_ahead(2, 2)  # the last step: nothing more
    assert [b.step for b in sampler.ahead] == [2, 3]
