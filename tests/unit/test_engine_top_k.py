"""Unit tests for unpacking vLLM's per-position prompt logprobs into the teacher's top-k."""

from __future__ import annotations

import pytest
from vllm.logprobs import Logprob

from opd_trainer.engine import top_k_of_position
from opd_trainer.errors import EngineError


def _entry(logprob: float, rank: int) -> Logprob:
    return Logprob(logprob=logprob, rank=rank, decoded_token=None)


def test_scored_token_outside_the_top_k_is_dropped() -> None:
    # As vLLM builds it: the scored token (id 9, rank 5) first, then ranks 1..3.
    entries = {9: _entry(-4.0, 5), 3: _entry(-0.5, 1), 7: _entry(-1.5, 2), 1: _entry(-2.0, 3)}
    assert top_k_of_position(entries, 3) == ([3, 7, 1], [-0.5, -1.5, -2.0])


def test_scored_token_inside_the_top_k_is_kept_once_in_rank_order() -> None:
    # The scored token 7 is rank 2: vLLM's dict keeps its first slot, with the top-k entry's value.
    entries = {7: _entry(-1.5, 2), 3: _entry(-0.5, 1), 1: _entry(-2.0, 3)}
    assert top_k_of_position(entries, 3) == ([3, 7, 1], [-0.5, -1.5, -2.0])


def test_unexpected_entry_count_is_an_error() -> None:
    with pytest.raises(EngineError, match="expected 3 or 4"):
        top_k_of_position({3: _entry(-0.5, 1)}, 3)


def test_teacher_scores_and_segments_survive_pickling() -> None:
    # Both cross Ray (engine -> driver -> learner) as pickles.
    import pickle

    import numpy as np

    from opd_trainer.engine import TeacherScores
    from opd_trainer.learner import TrainSegment

    ids = np.array([[3, 7], [1, 2]], dtype=np.int32)
    logprobs = np.array([[-0.5, -1.5], [-0.1, -3.0]], dtype=np.float32)
    scores = pickle.loads(pickle.dumps(TeacherScores(logprobs[:, 0], ids, logprobs)))
    segment = pickle.loads(
        pickle.dumps(TrainSegment([1], [3, 1], [-0.6, -0.2], [-0.5, -0.1], 0, 0, 0.0, ids, logprobs))
    )
    for got in (scores.top_ids, segment.teacher_top_ids):
        assert got.dtype == np.int32 and np.array_equal(got, ids)
    for got in (scores.top_logprobs, segment.teacher_top_logprobs):
        assert got.dtype == np.float32 and np.array_equal(got, logprobs)
