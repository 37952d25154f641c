"""benchmarks/learner_step.py's batch (no learner): the shapes the update is timed on."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import learner_step  # noqa: E402

from opd_trainer.learner.batch import pad_segments  # noqa: E402


def test_the_batch_holds_n_rollouts_scored_completions_of_each_prompt() -> None:
    prompts = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 6, 7, 8]]
    batch = learner_step.segments(prompts, n_rollouts=2, max_tokens=5, top_k=3, vocab=50)
    assert [s.group_id for s in batch] == [0, 0, 1, 1, 2, 2]
    assert [s.prompt_token_ids for s in batch[::2]] == prompts
    for segment in batch:
        length = len(segment.completion_token_ids)
        assert 1 <= length <= 5
        assert len(segment.sampler_logprobs) == len(segment.teacher_logprobs) == length
        assert segment.teacher_top_ids.shape == segment.teacher_top_logprobs.shape == (length, 3)
        # The teacher's top-k by rank, as vLLM returns it.
        assert np.all(np.diff(segment.teacher_top_logprobs, axis=1) <= 0)
    # It is a batch the learner takes as it is.
    assert pad_segments(batch, 3, "cpu").top_ids_B_T_K is not None
