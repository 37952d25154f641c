"""The turn-level preference term's DPO-style loss and the beacon rewrites' supervised term; the pairs
they read are mined and marked by the training signal (`signal/pairs.py`, `signal/beacons.py`).

Loss (`preference_loss`, per mini-batch): with r = Σ over the side's trained tokens of
(log π_θ − log π_ref), the pair's term is −log σ(β (r_chosen − r_rejected)) (DPO, no reward model),
summed over the mini-batch's pairs and divided by its prompts (`turn_preference_reduction: prompts`, so
that a step with two pairs among 32 prompts gives them 2/32 of the weight a pair per prompt would have;
'pairs' takes their mean), weighted by `turn_preference_coef`. The reference π_ref is
`turn_preference_reference`: the frozen starting student (default, every margin 0 at step 1), that
copy refreshed every K steps ('rolling'), or the teacher's scoring of the same tokens. Only the turn's
completion tokens count (tool-call tokens included; tool output is the next turn's prompt, never
trained). A pair whose two rows fall in different mini-batches is not trained
(`preference/split_pairs`); the driver's mini-batches keep a prompt's rollouts together whenever
`ppo_mini_batch_size` is a multiple of `n_rollouts`, and learner ranks split mini-batches by prompt, so a
pair never straddles two ranks. With several learner ranks each rank divides by the prompts of its own
shard (the ranks' gradients are then averaged, as for the other terms).

`beacon_sft_loss`: the kept beacon rewrites' mean token NLL (`beacon_sft_coef`, the improved action as
a supervised positive).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from opd_trainer.records import CHOSEN, REJECTED


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
    the improved action as a supervised target). Zero (with the graph kept)
    when the batch holds none. With several learner ranks each normalises by its own shard's rewrite
    tokens (the ranks' gradients are then averaged, so a rank without rewrites dilutes the term: an
    approximation, as the per-prompt reduction's)."""
    weights_B_T = mask_B_T * rows_B.to(mask_B_T.dtype).unsqueeze(1)
    tokens = weights_B_T.sum()
    if float(tokens) == 0:
        return learner_B_T.sum() * 0.0, {}
    loss = -(learner_B_T * weights_B_T).sum() / tokens
    return loss, {"beacons/sft_nll": float(loss.detach()), "beacons/sft_tokens": float(tokens)}
