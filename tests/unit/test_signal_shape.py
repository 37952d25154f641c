"""The training signal (`opd_trainer/signal/`): `shape_signal` chains the shaping steps in order, each
adding its metrics; a step left with nothing to train fails; the teacher's scores reach a call through
one function; and the package sits below the driver and beside the learner."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest
from turns import turn

from opd_trainer.errors import OPDError
from opd_trainer.jobspec.job_spec import HyperParameters
from opd_trainer.records import CHOSEN, REJECTED, LLMCall
from opd_trainer.signal.scores import with_teacher_scores
from opd_trainer.signal.shape import shape_signal
from opd_trainer.signal.shaped import Shaped

SIGNAL = Path(__file__).resolve().parents[2] / "opd_trainer" / "signal"


def _shape(segments: list[LLMCall], step: int, **hyper_parameters: object) -> Shaped:
    return asyncio.run(shape_signal(segments, step, HyperParameters.model_validate(hyper_parameters)))


def test_every_step_on_adds_its_metrics_in_order_and_marks_the_segments() -> None:
    segments = [
        turn([1], [5], rollout=0, reward=1.0),
        turn([1], [6], rollout=1, reward=0.0),
        dataclasses.replace(turn([1], [7], rollout=2, reward=0.5), text="in hindsight, 7"),  # leaks
    ]
    shaped = _shape(segments, 0, teacher_hindsight="reference", hindsight_coef=0.1, turn_preference_coef=0.5)
    assert [s.rollout_id for s in shaped.segments] == [0, 1]
    assert [s.hindsight for s in shaped.segments] == [1.0, -1.0]
    assert [s.preference_pairs for s in shaped.segments] == [((0, CHOSEN),), ((0, REJECTED),)]
    assert shaped.rewrites == []
    assert list(shaped.metrics)[:7] == [
        "staleness/mean",
        "staleness/max",
        "staleness/dropped_segments",
        "hindsight/teacher_note_share",
        "hindsight/leaked_rollouts",
        "hindsight/turns_up",
        "hindsight/turns_down",
    ]
    assert shaped.metrics["hindsight/leaked_rollouts"] == 1.0 and shaped.metrics["preference/pairs"] == 1.0


def test_with_every_step_off_only_staleness_is_measured_and_the_segments_pass_as_they_are() -> None:
    segments = [turn([1], [5], rollout=0, reward=1.0), turn([1], [6], rollout=1, reward=0.0)]
    shaped = _shape(segments, 0)
    assert shaped.segments == segments
    assert set(shaped.metrics) == {"staleness/mean", "staleness/max", "staleness/dropped_segments"}


def test_a_step_left_with_nothing_to_train_fails_before_any_beacon_is_written() -> None:
    stale = dataclasses.replace(turn([1], [5], rollout=0, reward=1.0), weight_version=0)
    with pytest.raises(OPDError, match=r"step 4: no segment left.*'staleness/dropped_segments': 1.0"):
        # No beacon models given: reaching the beacons would fail differently.
        _shape([stale], 3, max_staleness=1, beacon_rewrite="teacher", turn_preference_coef=1.0)


def test_then_keeps_the_earlier_metrics_and_rewrites_first() -> None:
    first = Shaped([turn([1], [5], 0, 1.0)], {"a": 1.0}, [turn([2], [6], 0, 1.0)])
    after = Shaped([], {"b": 2.0}, [turn([3], [7], 0, 1.0)])
    joined = first.then(after)
    assert joined.segments == [] and list(joined.metrics) == ["a", "b"]
    assert [r.prompt_token_ids for r in joined.rewrites] == [[2], [3]]


@dataclasses.dataclass(frozen=True)
class _Scores:
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclasses.dataclass(frozen=True)
class _Scored:
    scores: _Scores
    teacher: str
    latency_s: float


def test_a_call_gains_the_teachers_scores_and_its_top_k_only_when_asked() -> None:
    scored = _Scored(
        _Scores(np.array([-0.5, -1.5], np.float32), np.zeros((2, 3), np.int32), np.zeros((2, 3))), "t", 0.2
    )
    call = LLMCall([1], [2, 3], [-1.0, -1.0], rollout_id=4)
    with_top = with_teacher_scores(call, scored, top_k=3, saw_note=True)
    assert with_top.teacher_logprobs == [-0.5, -1.5] and with_top.teacher_top_ids is scored.scores.top_ids
    assert with_top.teacher_name == "t" and with_top.teacher_latency_s == 0.2 and with_top.teacher_saw_note
    assert with_top.rollout_id == 4  # nothing else changes
    plain = with_teacher_scores(call, scored, top_k=0)
    assert plain.teacher_top_ids is None and plain.teacher_top_logprobs is None and not plain.teacher_saw_note


def test_the_signal_imports_neither_the_driver_nor_the_learner() -> None:
    """Anywhere in the file: at module level, in a function, under `if TYPE_CHECKING:`."""
    found = []
    for path in sorted(SIGNAL.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [
                f"{path.name}: {name}"
                for name in names
                if name.startswith(("opd_trainer.driver", "opd_trainer.learner"))
            ]
    assert found == []
