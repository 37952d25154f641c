"""Turn-level preference pairs (TurnSight's signal): where a better trajectory's action and a worse
one's parted.

Mining (`mine_preference_pairs`, per step): per prompt, every pair of a trajectory with the group's
highest reward and one with its lowest (when they differ; with `turn_preference_min_chosen_reward` only
where the highest reaches it, else counted in `low_reward`) is walked turn by turn; at the first turn
where both saw the same context (identical prompt tokens) and answered differently, the better
trajectory's action is *chosen* and the worse one's *rejected*, provided the two answers are different
actions (`actions.action_of`: tool names and canonical arguments, else normalised reply text; answers
that differ only in wording are counted in `same_action`). A pair whose contexts part before its answers
do (a tool answered differently, say) gives no pair and is counted as skipped for context. Conflicts are
removed: an action (context + completion) chosen in one pair and rejected in another keeps none of its
pairs; a pair repeating a kept one's context and both answers is dropped (another best trajectory that
acted the same). Each kept pair's turn index is logged. Each pair is marked on its two segments
(`LLMCall.preference_pairs`: (pair id, `CHOSEN` / `REJECTED`)).

With `preference_level: outcome` (`mine_outcome_pairs`, the ablation's baseline) a pair is the whole
better trajectory against the whole worse one: every trained turn of each.

The learner's loss on the marked pairs: `learner/preference_loss.py`.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from opd_trainer.actions import action_of
from opd_trainer.records import CHOSEN, REJECTED, LLMCall
from opd_trainer.signal.shaped import Shaped

Pair = tuple[tuple[int, ...], tuple[int, ...]]
"""(chosen segment indices, rejected segment indices): one turn each at the turn level, every trained
turn of the two trajectories at the outcome level."""


TURN_BUCKETS = 8
"""Pairs are counted per turn index up to this one (`preference/turn_<k>`; later turns in the last)."""


@dataclass(frozen=True)
class MinedPairs:
    """What one step's mining found."""

    pairs: list[Pair]
    """The kept pairs, in mining order."""
    skipped_context: int
    """Best/worst trajectory pairs whose contexts parted before their answers did."""
    conflicting: int
    """Pairs removed because one of their actions (context + answer) was chosen in one pair and
    rejected in another."""
    duplicates: int = 0
    """Pairs dropped as the same context, chosen answer and rejected answer as a kept one."""
    same_action: int = 0
    """Best/worst pairs whose first differing answers were the same action (`actions.action_of`: the
    same tool calls and arguments, or the same normalised reply): wording, not a decision."""
    low_reward: int = 0
    """Best/worst pairs skipped because the best trajectory's reward was under
    `turn_preference_min_chosen_reward`."""
    turns: list[int] = dataclasses.field(default_factory=list)
    """Each kept pair's turn index (0: the first LLM call of the trajectory), in `pairs`' order."""

    def metrics(self) -> dict[str, float]:
        found = {
            "preference/pairs": float(len(self.pairs)),
            "preference/skipped_context": float(self.skipped_context),
            "preference/conflicting": float(self.conflicting),
            "preference/duplicates": float(self.duplicates),
            "preference/same_action": float(self.same_action),
            "preference/low_reward": float(self.low_reward),
        }
        if self.turns:
            found["preference/turn_index_mean"] = sum(self.turns) / len(self.turns)
            for turn in range(TURN_BUCKETS):
                found[f"preference/turn_{turn}"] = float(
                    sum(1 for t in self.turns if min(t, TURN_BUCKETS - 1) == turn)
                )
        return found


def best_worst_pairs(segments: list[LLMCall]) -> Iterator[tuple[list[int], list[int]]]:
    """Per prompt (`group_id`) whose trajectories' rewards differ, each (best, worst) pair of its
    trajectories (`rollout_id`) as their segment indices in call order: the walk every turn-level
    signal starts from (this module's pairs, `hindsight.py`'s advantages)."""
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


def diverging_turn(better: list[LLMCall], worse: list[LLMCall]) -> int | Literal["context"] | None:
    """The first turn at which two trajectories (their turns in call order) saw the same context and
    answered differently; "context" when their contexts parted before their answers did; None when one
    ended first. This module's pairs and `hindsight.py`'s advantages both start from it."""
    for turn, (good, bad) in enumerate(zip(better, worse, strict=False)):
        if good.prompt_token_ids != bad.prompt_token_ids:
            return "context"
        if good.completion_token_ids != bad.completion_token_ids:
            return turn
    return None


@dataclass
class _Candidates:
    pairs: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # chosen, rejected, turn
    skipped_context: int = 0
    same_action: int = 0
    low_reward: int = 0


def _candidate_pairs(segments: list[LLMCall], min_chosen_reward: float | None) -> _Candidates:
    found = _Candidates()
    for good, bad in best_worst_pairs(segments):
        if min_chosen_reward is not None and segments[good[0]].reward < min_chosen_reward:
            found.low_reward += 1
            continue
        turn = diverging_turn([segments[i] for i in good], [segments[i] for i in bad])
        if turn == "context":
            found.skipped_context += 1
        elif isinstance(turn, int):
            if action_of(segments[good[turn]]) == action_of(segments[bad[turn]]):
                found.same_action += 1
            else:
                found.pairs.append((good[turn], bad[turn], turn))
    return found


def _action(segment: LLMCall) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(segment.prompt_token_ids), tuple(segment.completion_token_ids)


def mine_preference_pairs(segments: list[LLMCall], min_chosen_reward: float | None = None) -> MinedPairs:
    """The step's turn-level preference pairs over `segments` (one step's, as `score_rollouts` builds them:
    each trajectory's turns in call order, `group_id` the prompt, `reward` the trajectory's); with
    `min_chosen_reward`, only where the better trajectory reached it."""
    found = _candidate_pairs(segments, min_chosen_reward)
    roles: dict[tuple[tuple[int, ...], tuple[int, ...]], set[int]] = defaultdict(set)
    for chosen, rejected, _ in found.pairs:
        roles[_action(segments[chosen])].add(CHOSEN)
        roles[_action(segments[rejected])].add(REJECTED)
    kept: list[Pair] = []
    turns: list[int] = []
    seen: set[tuple[object, ...]] = set()
    conflicting = duplicates = 0
    for chosen, rejected, turn in found.pairs:
        good, bad = _action(segments[chosen]), _action(segments[rejected])
        if len(roles[good]) > 1 or len(roles[bad]) > 1:
            conflicting += 1
        elif (good, bad[1]) in seen:
            duplicates += 1
        else:
            seen.add((good, bad[1]))
            kept.append(((chosen,), (rejected,)))
            turns.append(turn)
    return MinedPairs(
        kept,
        skipped_context=found.skipped_context,
        conflicting=conflicting,
        duplicates=duplicates,
        same_action=found.same_action,
        low_reward=found.low_reward,
        turns=turns,
    )


def mine_outcome_pairs(segments: list[LLMCall], min_chosen_reward: float | None = None) -> MinedPairs:
    """Outcome-level pairs (the ablation's baseline): per prompt, every trajectory with the group's
    highest reward against every one with its lowest (when they differ), each side all its trained
    turns. Turns the two share (same context, same answer) have the same log-ratio on both sides and
    cancel in the margin, so nothing is removed as conflicting."""
    pairs: list[Pair] = []
    low_reward = 0
    for good, bad in best_worst_pairs(segments):
        if min_chosen_reward is not None and segments[good[0]].reward < min_chosen_reward:
            low_reward += 1
        else:
            pairs.append((tuple(good), tuple(bad)))
    return MinedPairs(pairs, skipped_context=0, conflicting=0, low_reward=low_reward)


def mark_pairs(segments: list[LLMCall], pairs: list[Pair]) -> list[LLMCall]:
    """`segments` with each pair's id and side on its segments (`LLMCall.preference_pairs`)."""
    marks: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for pair_id, (chosen, rejected) in enumerate(pairs):
        for index in chosen:
            marks[index].append((pair_id, CHOSEN))
        for index in rejected:
            marks[index].append((pair_id, REJECTED))
    return [
        dataclasses.replace(s, preference_pairs=tuple(marks[i])) if i in marks else s
        for i, s in enumerate(segments)
    ]


def pairs_split_across(minibatches: list[list[LLMCall]]) -> int:
    """Pairs whose two actions fall in different mini-batches (neither trains on them)."""
    where: dict[int, set[int]] = defaultdict(set)
    for index, minibatch in enumerate(minibatches):
        for segment in minibatch:
            for pair_id, _ in segment.preference_pairs:
                where[pair_id].add(index)
    return sum(1 for batches in where.values() if len(batches) > 1)


def add_preference_pairs(segments: list[LLMCall], level: str, min_chosen_reward: float | None) -> Shaped:
    """`segments` with the step's preference pairs marked on them (`mark_pairs`): turn-level pairs
    (`level` 'turn', `mine_preference_pairs`) or whole trajectories ('outcome', `mine_outcome_pairs`).
    Metrics: `MinedPairs.metrics`."""
    mine = mine_preference_pairs if level == "turn" else mine_outcome_pairs
    mined = mine(segments, min_chosen_reward)
    return Shaped(mark_pairs(segments, mined.pairs), mined.metrics())
