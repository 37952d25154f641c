"""The teacher's scores on the student's calls: every recorded LLM call of a successful rollout becomes a
segment the teacher scored on exactly the student's tokens (its top-k too when the estimator needs
it), with the hindsight note in the teacher's prompt where `teacher_hindsight` asks (`notes.py`).

`with_teacher_scores` is the one place a call gains a teacher's scores: the step's segments
(`score_rollouts`) and the beacons' rewrites (`beacons.py`) both go through it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from opd_trainer.jobspec.dataset import Sample
from opd_trainer.jobspec.job_spec import HyperParameters
from opd_trainer.records import LLMCall
from opd_trainer.signal.notes import hindsight_notes, teacher_inputs

if TYPE_CHECKING:
    from opd_trainer.rollout.runner import RolloutResult

Pair = tuple[list[int], list[int]]
"""(prompt ids, completion ids): what a teacher scores."""


class TokenScores(Protocol):
    """A model's scores of one completion, one row per completion token (`engine.TeacherScores`)."""

    @property
    def logprobs(self) -> np.ndarray: ...  # [T] float32
    @property
    def top_ids(self) -> np.ndarray: ...  # [T, K] int32
    @property
    def top_logprobs(self) -> np.ndarray: ...  # [T, K] float32


class ScoredPair(Protocol):
    """One pair as a teacher scored it (`driver.teachers.Scored`)."""

    @property
    def scores(self) -> TokenScores: ...
    @property
    def teacher(self) -> str: ...
    @property
    def latency_s(self) -> float: ...


class TeacherScoring(Protocol):
    """A job's teachers as scorers (`driver.teachers.TeacherEngines`)."""

    def name_for(self, sample: Sample) -> str:
        """The teacher that scores `sample`."""
        ...

    async def score_top_k(self, names: list[str], pairs: list[Pair], top_k: int) -> Sequence[ScoredPair]:
        """Each pair scored by the teacher `names` gives it, with its `top_k` tokens per position."""
        ...


def with_teacher_scores(call: LLMCall, scored: ScoredPair, top_k: int, saw_note: bool = False) -> LLMCall:
    """`call` with the teacher's scores of its completion: its logprobs, with `top_k` > 0 its top-k ids
    and logprobs, the teacher's name, the request's seconds and whether its prompt held a note."""
    return dataclasses.replace(
        call,
        teacher_logprobs=scored.scores.logprobs.tolist(),
        teacher_top_ids=scored.scores.top_ids if top_k else None,
        teacher_top_logprobs=scored.scores.top_logprobs if top_k else None,
        teacher_saw_note=saw_note,
        teacher_name=scored.teacher,
        teacher_latency_s=scored.latency_s,
    )


async def score_rollouts(
    teachers: TeacherScoring,
    tokenizer: Any,
    max_length: int,
    hp: HyperParameters,
    results: list[RolloutResult],
) -> list[LLMCall]:
    """One segment per recorded LLM call of every successful rollout (rollout order, then call order),
    scored on the student's exact tokens by the teacher its sample is routed to (with the hindsight note
    in its prompt where `teacher_hindsight` asks), with its prompt group, rollout index and reward."""
    calls = [(r, c) for r in results if not r.failed for c in r.calls if c.completion_token_ids]
    notes = [note for r in results if not r.failed for note in hindsight_notes(r, hp.teacher_hindsight)]
    noted_calls = [(c, note) for (_, c), note in zip(calls, notes, strict=True)]
    inputs = teacher_inputs(tokenizer, noted_calls, max_length)
    names = [teachers.name_for(r.sample) for r, _ in calls]
    scored = await teachers.score_top_k(names, inputs.pairs, hp.teacher_top_k)
    return [
        with_teacher_scores(
            dataclasses.replace(c, group_id=r.group_id, rollout_id=r.index, reward=r.reward),
            one,
            hp.teacher_top_k,
            saw_note=noted,
        )
        for (r, c), one, noted in zip(calls, scored, inputs.noted, strict=True)
    ]
