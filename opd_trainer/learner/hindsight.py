"""Turn-level hindsight advantages: where a failed trajectory parted from a successful sibling.

Per prompt, a step samples `n_rollouts` trajectories and knows how each ended (its reward). For each
pair of a best and a worst trajectory of the prompt (reward = the group's highest vs its lowest, when
they differ), the turns are compared in order: while both made the same call from the same context
nothing is learned; at the first turn where they saw the same context (prompt tokens) but answered
differently, the better trajectory's turn gets +1 and the worse one's −1. Turns before the divergence
get nothing, and so do the turns after it (their contexts differ, so they are not comparable), as do
pairs whose contexts differ before their answers do (e.g. a tool answered differently). A turn in
several pairs gets the mean of its ±1s. The learner adds `hindsight_coef ×` this value to the
advantage of every trained token of the turn (the policy-gradient term), beside the distillation
signal and the reward (seed 003: the turn, not the token or the whole trajectory, is the unit).

A single-turn job is the special case where every pair diverges at turn 0: the best completions of a
prompt are pushed up and the worst down.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from opd_trainer.records import LLMCall


def diverging_turn(better: list[LLMCall], worse: list[LLMCall]) -> int | None:
    """The first turn at which two trajectories saw the same context and answered differently; None
    when one ends first, or their contexts part before their answers do."""
    for turn, (good, bad) in enumerate(zip(better, worse, strict=False)):
        if good.prompt_token_ids != bad.prompt_token_ids:
            return None
        if good.completion_token_ids != bad.completion_token_ids:
            return turn
    return None


def best_worst_pairs(segments: list[LLMCall]) -> Iterator[tuple[list[int], list[int]]]:
    """Per prompt (`group_id`) whose trajectories' rewards differ, each (best, worst) pair of its
    trajectories (`rollout_id`) as their segment indices in call order: the walk every turn-level
    signal starts from (this module's advantages, `learner/turn_preference.py`'s pairs)."""
    trajectories: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for index, segment in enumerate(segments):
        trajectories[segment.group_id][segment.rollout_id].append(index)
    for rollouts in trajectories.values():
        rewards = {rollout: segments[turns[0]].reward for rollout, turns in rollouts.items()}
        best, worst = max(rewards.values()), min(rewards.values())
        if best == worst:
            continue
        for good in (r for r, reward in rewards.items() if reward == best):
            for bad in (r for r, reward in rewards.items() if reward == worst):
                yield rollouts[good], rollouts[bad]


def hindsight_advantages(segments: list[LLMCall]) -> list[float]:
    """One value per segment (input order): the mean of its ±1s over the best/worst pairs of its
    prompt that diverge at it, else 0. Segments are one prompt group's (`group_id`) trajectories
    (`rollout_id`), each trajectory's turns in call order, as the driver builds them."""
    totals: dict[int, float] = defaultdict(float)
    counts: dict[int, int] = defaultdict(int)
    for good, bad in best_worst_pairs(segments):
        turn = diverging_turn([segments[i] for i in good], [segments[i] for i in bad])
        if turn is None:
            continue
        for index, sign in ((good[turn], 1.0), (bad[turn], -1.0)):
            totals[index] += sign
            counts[index] += 1
    return [totals[i] / counts[i] if counts[i] else 0.0 for i in range(len(segments))]
