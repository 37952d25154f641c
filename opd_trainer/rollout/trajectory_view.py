"""The teacher's view of a trajectory's trained tokens, as the trajectory log records it and the console
colours it: per trained call, each completion token's text and sampler − teacher log-ratio (the
teacher's top-1 and its probability where its top-k is known), and the turn's other training signals.
`scored_trajectories` joins a step's trained segments to its first rollouts; `driver/step.py` calls it
once the step's segments are scored.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from opd_trainer.records import LLMCall

if TYPE_CHECKING:
    from opd_trainer.rollout.runner import RolloutResult

CallTokens = dict[str, Any]
"""One trained call's completion tokens as parallel lists, one entry per token:

- `text`: the token's text, each id decoded alone (a piece of a multi-byte character reads as U+FFFD);
- `log_ratio`: sampler logprob − teacher logprob of the sampled token (> 0: the teacher finds it less
  likely than the student did), 4 decimals;
- with the teacher's top-k known (`teacher_top_k` > 0): `teacher_top`, the teacher's most likely token
  at that position (text), and `teacher_top_p`, its probability, 4 decimals;

and, for the whole turn, `signal` when it carries a training signal besides the distillation (only
the keys that apply, `turn_signal`): `hindsight` (its turn-level hindsight value), `preference` (its
side, "chosen" / "rejected", in each preference pair it belongs to), `rewrite` (where a beacon's
rewrite is preferred over it: `{"text": the rewrite, "beacon": the beacon it was written with}`) and
`teacher_saw_note` (the teacher scored it with a hindsight note)."""


def turn_signal(segment: LLMCall, rewrites: dict[int, LLMCall] | None = None) -> dict[str, Any]:
    """The turn's signals besides the distillation, as the trajectory view shows them beside it;
    `rewrites`: the step's beacon rewrites by the pair they are the chosen side of."""
    signal: dict[str, Any] = {}
    if segment.hindsight:
        signal["hindsight"] = round(segment.hindsight, 4)
    if segment.preference_pairs:
        signal["preference"] = ["chosen" if side > 0 else "rejected" for _, side in segment.preference_pairs]
        for pair_id, side in segment.preference_pairs:
            rewrite = (rewrites or {}).get(pair_id)
            if side < 0 and rewrite is not None:
                signal["rewrite"] = {"text": rewrite.text, "beacon": rewrite.beacon}
    if segment.teacher_saw_note:
        signal["teacher_saw_note"] = True
    return signal


def token_texts(tokenizer: Any, token_ids: set[int]) -> dict[int, str]:
    """The text of each distinct token id, decoded alone."""
    return {token_id: tokenizer.decode([token_id]) for token_id in token_ids}


def _teacher_top1(segment: LLMCall) -> tuple[np.ndarray, np.ndarray] | None:
    """The teacher's most likely token id and its probability at each completion position, None where
    its top-k is unknown."""
    top_ids, top_logprobs = segment.teacher_top_ids, segment.teacher_top_logprobs
    if top_ids is None or top_logprobs is None or top_ids.size == 0:
        return None
    rows = np.arange(top_ids.shape[0])
    best = top_logprobs.argmax(axis=1)
    return top_ids[rows, best], np.exp(top_logprobs[rows, best].astype(np.float64))


def call_tokens(
    segment: LLMCall, texts: dict[int, str], rewrites: dict[int, LLMCall] | None = None
) -> CallTokens:
    """A scored segment's per-token view (`CallTokens`); `texts` holds every id it names, `rewrites` the
    step's beacon rewrites by pair id (`turn_signal`)."""
    sampler = np.asarray(segment.sampler_logprobs, dtype=np.float64)
    teacher = np.asarray(segment.teacher_logprobs, dtype=np.float64)
    view: CallTokens = {
        "text": [texts[token_id] for token_id in segment.completion_token_ids],
        "log_ratio": np.round(sampler - teacher, 4).tolist(),
    }
    top1 = _teacher_top1(segment)
    if top1 is not None:
        view["teacher_top"] = [texts[int(token_id)] for token_id in top1[0]]
        view["teacher_top_p"] = np.round(top1[1], 4).tolist()
    signal = turn_signal(segment, rewrites)
    if signal:
        view["signal"] = signal
    return view


def mean_log_ratio(calls: list[CallTokens]) -> float | None:
    """The mean finite log-ratio over the tokens of `calls`; None when there is none."""
    values = [v for call in calls for v in call["log_ratio"] if math.isfinite(v)]
    return sum(values) / len(values) if values else None


def segments_by_call(result: RolloutResult, segments: list[LLMCall]) -> list[LLMCall | None]:
    """For each of the rollout's calls, in order, its trained segment: `segments` are this rollout's
    trained segments in call order (`signal/scores.score_rollouts` keeps it), matched to the calls by
    their tokens, so a call without a completion or whose segment was dropped gets None."""
    pending = list(reversed(segments))
    matched: list[LLMCall | None] = []
    for call in result.calls:
        segment = pending[-1] if pending else None
        same = (
            segment is not None
            and segment.completion_token_ids == call.completion_token_ids
            and segment.prompt_token_ids == call.prompt_token_ids
        )
        matched.append(pending.pop() if same else None)
    return matched


def scored_trajectories(
    results: list[RolloutResult],
    segments: list[LLMCall],
    tokenizer: Any,
    step: int,
    rewrites: list[LLMCall] | None = None,
) -> list[dict[str, Any]]:
    """The trajectory records of `results` with the trained tokens of each call (`CallTokens`), from the
    step's trained `segments` joined by rollout index (`LLMCall.rollout_id` = `RolloutResult.index`)
    and call order; `rewrites`, the step's beacon rewrites, shown beside the turns they are preferred
    over. Ids are decoded once per distinct id over all of them."""
    by_pair = {pair_id: r for r in rewrites or [] for pair_id, side in r.preference_pairs if side > 0}
    wanted = {r.index for r in results}
    own: dict[int, list[LLMCall]] = {index: [] for index in wanted}
    for segment in segments:
        if segment.rollout_id in wanted:
            own[segment.rollout_id].append(segment)
    matched = {r.index: segments_by_call(r, own[r.index]) for r in results}
    trained = [s for calls in matched.values() for s in calls if s is not None]
    texts = token_texts(tokenizer, _named_ids(trained))
    return [
        r.trajectory(step, [None if s is None else call_tokens(s, texts, by_pair) for s in matched[r.index]])
        for r in results
    ]


def _named_ids(segments: list[LLMCall]) -> set[int]:
    """The token ids the segments' views name: their completions and, where known, the teacher's top-1."""
    arrays = [np.asarray(s.completion_token_ids, dtype=np.int64) for s in segments]
    arrays += [top1[0].astype(np.int64) for top1 in map(_teacher_top1, segments) if top1 is not None]
    return set(np.unique(np.concatenate(arrays)).tolist()) if arrays else set()
