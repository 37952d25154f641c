"""`RecentScores`: the rows a later scoring request finds hidden by the prefix cache."""

from __future__ import annotations

import numpy as np

from opd_trainer.engine.recent_scores import RecentScores


def _rows(sequence: list[int], first: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows whose values name their position, so that a slice shows where it came from."""
    positions = np.arange(first, len(sequence), dtype=np.float32)[:, None]
    ids = np.tile(np.array(sequence[first:], dtype=np.int32)[:, None], (1, width))
    return ids, positions + np.zeros((1, width), dtype=np.float32)


def test_the_hidden_positions_come_from_a_sequence_with_the_same_tokens_up_to_the_last_one() -> None:
    recent = RecentScores()
    prompt = [1, 2, 3, 4]
    earlier = [*prompt, 10, 11, 12, 13]
    recent.add(earlier, 4, *_rows(earlier, 4, 3))
    sibling = [*prompt, 10, 11, 20, 21]
    ids, logprobs = recent.rows(sibling, first=4, last=5, width=3)
    assert ids[:, 0].tolist() == [10, 11]
    assert logprobs[:, 0].tolist() == [4.0, 5.0]
    # A token that differs at or before the last hidden position: nothing to reuse.
    assert recent.rows(sibling, first=4, last=6, width=3) is None
    assert recent.rows([*prompt, 10, 99, 12], first=4, last=5, width=3) is None


def test_rows_of_another_width_a_later_start_or_too_short_a_sequence_are_not_used() -> None:
    recent = RecentScores()
    sequence = [1, 2, 3, 4, 5, 6]
    recent.add(sequence, 3, *_rows(sequence, 3, 2))
    assert recent.rows(sequence, first=3, last=4, width=5) is None  # the rows hold top-1, not top-4
    assert recent.rows(sequence, first=2, last=4, width=2) is None  # position 2 was never scored
    assert recent.rows([*sequence, 7, 8], first=3, last=6, width=2) is None  # scored only to position 5
    assert recent.rows([*sequence, 7, 8], first=4, last=5, width=2)[1][:, 0].tolist() == [4.0, 5.0]


def test_the_latest_match_wins_only_the_last_capacity_are_kept_and_clear_forgets() -> None:
    recent = RecentScores(capacity=2)
    sequence = [1, 2, 3, 4]
    for offset in (0.0, 100.0, 200.0):
        ids, logprobs = _rows(sequence, 2, 1)
        recent.add(sequence, 2, ids, logprobs + offset)
    assert len(recent) == 2
    assert recent.rows(sequence, first=2, last=3, width=1)[1][:, 0].tolist() == [202.0, 203.0]
    recent.clear()
    assert len(recent) == 0 and recent.rows(sequence, first=2, last=3, width=1) is None
