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
signal and the reward (the turn, not the token or the whole trajectory, is the unit).

A single-turn job is the special case where every pair diverges at turn 0: the best completions of a
prompt are pushed up and the worst down.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from opd_trainer.records import LLMCall
from opd_trainer.signal.pairs import best_worst_pairs, diverging_turn
from opd_trainer.signal.shaped import Shaped


def hindsight_advantages(segments: list[LLMCall]) -> list[float]:
    """One value per segment (input order): the mean of its ±1s over the best/worst pairs of its
    prompt that diverge at it, else 0. Segments are one prompt group's (`group_id`) trajectories
    (`rollout_id`), each trajectory's turns in call order, as `scores.score_rollouts` builds them."""
    totals: dict[int, float] = defaultdict(float)
    counts: dict[int, int] = defaultdict(int)
    for good, bad in best_worst_pairs(segments):
        turn = diverging_turn([segments[i] for i in good], [segments[i] for i in bad])
        if not isinstance(turn, int):  # one ended first, or their contexts parted first
            continue
        for index, sign in ((good[turn], 1.0), (bad[turn], -1.0)):
            totals[index] += sign
            counts[index] += 1
    return [totals[i] / counts[i] if counts[i] else 0.0 for i in range(len(segments))]


def add_hindsight(segments: list[LLMCall]) -> Shaped:
    """`segments` with their hindsight values (`LLMCall.hindsight`, `hindsight_advantages`). Metrics:
    `hindsight/turns_up`, `hindsight/turns_down` (segments pushed up, down)."""
    values = hindsight_advantages(segments)
    marked = [dataclasses.replace(s, hindsight=v) for s, v in zip(segments, values, strict=True)]
    metrics = {
        "hindsight/turns_up": float(sum(v > 0 for v in values)),
        "hindsight/turns_down": float(sum(v < 0 for v in values)),
    }
    return Shaped(marked, metrics)
