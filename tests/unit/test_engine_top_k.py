"""Unit tests for unpacking vLLM's flat prompt logprobs into the teacher's sampled-token and top-k rows."""

from __future__ import annotations

import numpy as np
import pytest
from vllm.logprobs import FlatLogprobs, append_logprobs_for_next_position

from opd_trainer.engine.vllm_engine import completion_rows
from opd_trainer.errors import EngineError


def _flat(positions: list[tuple[list[int], list[float], int]], top_k: int) -> FlatLogprobs:
    """FlatLogprobs built by vLLM's own appender: per position (ids, logprobs, rank of the scored token),
    with ids/logprobs = [scored token, top 1..k]; the first prompt position has none."""
    flat = FlatLogprobs()
    flat.append(None)
    for ids, logprobs, rank in positions:
        append_logprobs_for_next_position(flat, ids, logprobs, [None] * len(ids), rank, top_k)
    return flat


def test_completion_positions_reshape_to_scored_token_then_ranks() -> None:
    # Prompt of 2 tokens, completion of 2: positions 1 (prompt), 2 and 3 (completion).
    flat = _flat(
        [
            ([5, 5, 6, 7], [-0.1, -0.1, -2.5, -3.0], 1),
            # scored token 9 is outside the top 3 (rank 5): its entry comes first, then ranks 1..3
            ([9, 3, 7, 1], [-4.0, -0.5, -1.5, -2.0], 5),
            # scored token 7 is rank 2: it appears twice, as vLLM sends it
            ([7, 3, 7, 1], [-1.5, -0.5, -1.5, -2.0], 2),
        ],
        3,
    )
    ids, logprobs = completion_rows(flat, 2, 2, 4)
    assert ids.dtype == np.int32 and logprobs.dtype == np.float32
    assert ids.tolist() == [[9, 3, 7, 1], [7, 3, 7, 1]]
    np.testing.assert_allclose(logprobs, [[-4.0, -0.5, -1.5, -2.0], [-1.5, -0.5, -1.5, -2.0]])


def test_sampled_token_only_is_one_column() -> None:
    flat = _flat([([4], [-0.7], 3), ([8], [-0.2], 1)], 0)
    ids, logprobs = completion_rows(flat, 1, 2, 1)
    assert ids.tolist() == [[4], [8]]
    np.testing.assert_allclose(logprobs[:, 0], [-0.7, -0.2])


def test_unexpected_entry_count_is_an_error() -> None:
    flat = _flat([([4, 4], [-0.7, -0.7], 1)], 1)
    with pytest.raises(EngineError, match="expected 3 prompt logprobs"):
        completion_rows(flat, 1, 1, 3)


def test_teacher_scores_and_segments_survive_pickling() -> None:
    # Both cross Ray (engine -> driver -> learner) as pickles.
    import pickle

    import numpy as np

    from opd_trainer.engine.vllm_engine import TeacherScores
    from opd_trainer.records import LLMCall

    ids = np.array([[3, 7], [1, 2]], dtype=np.int32)
    logprobs = np.array([[-0.5, -1.5], [-0.1, -3.0]], dtype=np.float32)
    scores = pickle.loads(pickle.dumps(TeacherScores(logprobs[:, 0], ids, logprobs)))
    segment = pickle.loads(
        pickle.dumps(
            LLMCall(
                [1],
                [3, 1],
                [-0.6, -0.2],
                teacher_logprobs=[-0.5, -0.1],
                teacher_top_ids=ids,
                teacher_top_logprobs=logprobs,
            )
        )
    )
    for got in (scores.top_ids, segment.teacher_top_ids):
        assert got.dtype == np.int32 and np.array_equal(got, ids)
    for got in (scores.top_logprobs, segment.teacher_top_logprobs):
        assert got.dtype == np.float32 and np.array_equal(got, logprobs)
