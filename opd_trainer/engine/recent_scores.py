"""The teacher's rows of recently scored sequences, to fill in the positions the prefix cache hides.

vLLM returns no prompt logprobs at positions it read from the prefix cache. A teacher scores a prompt's
completions one after another as rollouts end, so when two completions of one prompt begin with the
same tokens, the first one's cached blocks can reach into the second's completion, and the second
request comes back without the logprobs of those first completion tokens (`Engine._prompt_logprobs`).
Those tokens, and everything before them, are the same in both sequences, so their logprobs are the
ones the earlier request already returned: this keeps the last `capacity` scored sequences' rows and
hands back the rows of a recent sequence that agrees with the new one up to the last hidden position.
Without such a sequence the request is scored again without the cache (what was always done).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

DEFAULT_CAPACITY = 256


@dataclass(frozen=True)
class _Scored:
    sequence: list[int]
    first: int
    """Position of the first scored token (the prompt's length)."""
    ids: np.ndarray
    """[len(sequence) − first, width]: the scored token's id and the top-k ids at each position."""
    logprobs: np.ndarray


class RecentScores:
    """The rows of the last `capacity` scored sequences of one engine (module docstring)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._scored: collections.deque[_Scored] = collections.deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self._scored)

    def add(self, sequence: list[int], first: int, ids: np.ndarray, logprobs: np.ndarray) -> None:
        """`ids` / `logprobs`: the rows of positions `first` .. end of `sequence` ([T, width] each)."""
        self._scored.append(_Scored(list(sequence), first, ids, logprobs))

    def rows(
        self, sequence: list[int], first: int, last: int, width: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The rows of positions `first` .. `last` (inclusive) of `sequence`, from the latest scored
        sequence that holds the same tokens up to `last` and was scored from `first` or earlier with
        rows as wide; None when no such sequence is kept."""
        wanted = sequence[: last + 1]
        for scored in reversed(self._scored):
            if scored.ids.shape[1] != width or scored.first > first or len(scored.sequence) <= last:
                continue
            if scored.sequence[: last + 1] == wanted:
                start, end = first - scored.first, last - scored.first + 1
                return scored.ids[start:end], scored.logprobs[start:end]
        return None

    def clear(self) -> None:
        """Forgets every row (the engine's weights changed)."""
        self._scored.clear()
