"""Turn-level preference pairs (seed 003's TurnSight signal) and their DPO-style loss.

Mining (`mine_preference_pairs`, the driver, per step): per prompt, every pair of a trajectory with the
group's highest reward and one with its lowest (when they differ; with `turn_preference_min_chosen_reward`
only where the highest reaches it, else counted in `low_reward`) is walked turn by turn; at the first
turn where both saw the same context (identical prompt tokens) and answered differently, the better
trajectory's action is *chosen* and the worse one's *rejected*, provided the two answers are different
actions (`actions.action_of`: tool names and canonical arguments, else normalised reply text; answers
that differ only in wording are counted in `same_action`, seed 003 section 5.4). A pair whose contexts
part before its answers do (a tool answered differently, say) gives no pair and is counted as skipped
for context. Conflicts are removed: an action (context + completion) chosen in one pair and rejected in
another keeps none of its pairs; a pair repeating a kept one's context and both answers is dropped
(another best trajectory that acted the same). Each kept pair's turn index is logged. Each pair is
marked on its two segments (`LLMCall.preference_pairs`: (pair id, +1 chosen / −1 rejected)).

With `preference_level: outcome` (`mine_outcome_pairs`, the ablation's baseline) a pair is the whole
better trajectory against the whole worse one: every trained turn of each.

Loss (`preference_loss`, the learner, per mini-batch): with r = Σ over the side's trained tokens of
(log π_θ − log π_ref), the pair's term is −log σ(β (r_chosen − r_rejected)) (DPO, no reward model),
summed over the mini-batch's pairs and divided by its prompts (`turn_preference_reduction: prompts`, so
that a step with two pairs among 32 prompts gives them 2/32 of the weight a pair per prompt would have;
'pairs' takes their mean), weighted by `turn_preference_coef`. The reference π_ref is
`turn_preference_reference`: the frozen starting student (default: seed 003's `ref_model=None`, every
margin 0 at step 1), that copy refreshed every K steps ('rolling'), or the teacher's scoring of the same
tokens. Only the turn's completion tokens count (tool-call tokens included; tool output is the next
turn's prompt, never trained). A pair whose two rows fall in different mini-batches is not trained
(`preference/split_pairs`); the driver's mini-batches keep a prompt's rollouts together whenever
`ppo_mini_batch_size` is a multiple of `n_rollouts`, and learner ranks split mini-batches by prompt, so a
pair never straddles two ranks. With several learner ranks each rank divides by the prompts of its own
shard (the ranks' gradients are then averaged, as for the other terms).

`beacon_sft_loss`: the kept beacon rewrites' mean token NLL (`beacon_sft_coef`, seed 003's SFT positive).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor

from opd_trainer.actions import action_of
from opd_trainer.learner.hindsight import best_worst_pairs
from opd_trainer.records import LLMCall

CHOSEN, REJECTED = 1, -1

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


def _parting_turn(segments: list[LLMCall], better: list[int], worse: list[int]) -> int | str | None:
    """The turn where two trajectories answered the same context differently; "context" when their
    contexts parted first; None when one ended before they parted."""
    for turn, (good, bad) in enumerate(zip(better, worse, strict=False)):
        if segments[good].prompt_token_ids != segments[bad].prompt_token_ids:
            return "context"
        if segments[good].completion_token_ids != segments[bad].completion_token_ids:
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
        turn = _parting_turn(segments, good, bad)
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
    """The step's turn-level preference pairs over `segments` (one step's, as the driver builds them:
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
    """Outcome-level pairs (seed 003's ablation baseline): per prompt, every trajectory with the group's
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


def pair_sides(rows: list[tuple[tuple[int, int], ...]], device: torch.device | str = "cpu") -> Tensor:
    """[B, P] +1 / −1 where row b is (part of) pair p's chosen / rejected side, for the P pairs with
    both sides among `rows` (one mini-batch's `preference_pairs`); a pair with one side here is left
    out (a trajectory's turns are never split across mini-batches)."""
    sides: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for row, marks in enumerate(rows):
        for pair_id, side in marks:
            sides[pair_id][side].append(row)
    complete = [pair for pair, found in sorted(sides.items()) if len(found) == 2]
    matrix = torch.zeros((len(rows), len(complete)), device=device)
    for column, pair in enumerate(complete):
        matrix[sides[pair][CHOSEN], column] = 1.0
        matrix[sides[pair][REJECTED], column] = -1.0
    return matrix


def pairs_split_across(minibatches: list[list[LLMCall]]) -> int:
    """Pairs whose two actions fall in different mini-batches (neither trains on them)."""
    where: dict[int, set[int]] = defaultdict(set)
    for index, minibatch in enumerate(minibatches):
        for segment in minibatch:
            for pair_id, _ in segment.preference_pairs:
                where[pair_id].add(index)
    return sum(1 for batches in where.values() if len(batches) > 1)


def preference_loss(
    learner_B_T: Tensor,
    reference_B_T: Tensor,
    mask_B_T: Tensor,
    sides_B_P: Tensor,
    beta: float,
    per: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """−log σ(β (r_chosen − r_rejected)) over the P pairs, r = Σ_t mask (learner − reference) summed
    over the side's rows (`sides_B_P`): their mean, or with `per` their sum divided by `per` (the
    mini-batch's prompts: `turn_preference_reduction: prompts`, so that a step with two pairs does not
    hand them the whole term); with the share of pairs already ordered right (`preference/accuracy`)
    and the mean margin r_chosen − r_rejected (`preference/margin`). Zero (with the graph kept) when P
    is 0."""
    if sides_B_P.shape[1] == 0:
        return learner_B_T.sum() * 0.0, {}
    implicit_B = ((learner_B_T - reference_B_T) * mask_B_T).sum(dim=1)
    margin_P = sides_B_P.transpose(0, 1) @ implicit_B
    losses_P = -torch.nn.functional.logsigmoid(beta * margin_P)
    loss = losses_P.mean() if per is None else losses_P.sum() / max(per, 1)
    stats = {
        "preference/loss": float(loss.detach()),
        "preference/accuracy": float((margin_P.detach() > 0).float().mean()),
        "preference/margin": float(margin_P.detach().mean()),
        "preference/margin_abs_max": float(margin_P.detach().abs().max()),
    }
    return loss, stats


def beacon_sft_loss(learner_B_T: Tensor, mask_B_T: Tensor, rows_B: Tensor) -> tuple[Tensor, dict[str, float]]:
    """The kept beacon rewrites' (`rows_B`) mean negative log-likelihood per token (`beacon_sft_coef`:
    the improved action as a supervised target, seed 003's SFT positive). Zero (with the graph kept)
    when the batch holds none. With several learner ranks each normalises by its own shard's rewrite
    tokens (the ranks' gradients are then averaged, so a rank without rewrites dilutes the term: an
    approximation, as the per-prompt reduction's)."""
    weights_B_T = mask_B_T * rows_B.to(mask_B_T.dtype).unsqueeze(1)
    tokens = weights_B_T.sum()
    if float(tokens) == 0:
        return learner_B_T.sum() * 0.0, {}
    loss = -(learner_B_T * weights_B_T).sum() / tokens
    return loss, {"beacons/sft_nll": float(loss.detach()), "beacons/sft_tokens": float(tokens)}
