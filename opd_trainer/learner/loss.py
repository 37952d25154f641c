"""The building blocks of the distillation estimators and the learner's loss, as small pure tensor functions.

Which estimator a job runs, and which of these it combines, is declared once in `learner/estimators.py`
(`hyper_parameters.distill_loss`). Here:

- Over the teacher's top-k plus one tail bucket (suffix `K` / `J`, in the second half of this module):
  `topk_forward_kl_loss` (the default estimator, `topk_forward`), `topk_reverse_kl_loss` and
  `topk_jsd_loss`, direct losses on the student's logits; `topk_signal_baseline`, the per-position
  baseline of `sampled_baseline`; `topk_metrics`, how much of both models' mass the top-k covers.
- The sampled token's signal (`sampled`, `sampled_baseline`): `reverse_kl_advantages` /
  `opd_advantages`, the per-token advantage `A_t = −kl_coef·(logp_sampler_t − logp_teacher_t) +
  reward_coef·Â_row`, and `sampled_baseline_advantages`, the same minus the baseline.
- Shared by every estimator: `group_reward_advantages` (the reward term's `Â_row`: task reward minus
  its group's baseline) joined through `add_reward_advantages`; `gather_token_logprobs`, the learner's
  logprob of each sampled token; `policy_loss`, the truncated importance-sampled policy gradient
  `−Σ_t mask_t·min(ratio_t, cap)·A_t / N` that carries the reward (and, for the sampled estimators, the
  distillation) advantage; `kl_to_reference`, the optional `kl_loss_coef` term (KL to the initial
  student); `signal_std` and `distillation_metrics`, what is logged.

Shape suffixes (tinker-cookbook convention):

- `B`: rows of the batch. One row is one trained segment = one LLM call's prompt + completion,
  padded so that every row's completion starts at the same column (`batch.LearnerBatch`); a multi-turn
  rollout contributes several rows.
- `T`: token positions within a row.
- `V`: vocabulary.
- `R`, `G` (inside `group_reward_advantages` only): distinct rollouts, distinct prompt groups.

Every `*_logprobs_B_T` holds the per-token logprob of the token *actually at* that position (already
gathered), aligned with `mask_B_T`. `mask_B_T` is 1.0 exactly on completion tokens that carry loss and
0.0 on prompt, tool-result and padding tokens. Values at masked positions are never read: they may be
garbage (even ±inf or nan, e.g. a teacher that did not score padding) without changing any result or
gradient.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "add_reward_advantages",
    "bucket_forward_kl",
    "bucket_jsd",
    "bucket_reverse_kl",
    "by_tiles",
    "distillation_metrics",
    "full_vocab_reverse_kl",
    "gather_token_logprobs",
    "group_reward_advantages",
    "kl_to_reference",
    "opd_advantages",
    "policy_loss",
    "reverse_kl_advantages",
    "sampled_baseline_advantages",
    "signal_std",
    "student_bucket_logprobs",
    "teacher_bucket_logprobs",
    "topk_forward_kl_loss",
    "topk_jsd_loss",
    "topk_metrics",
    "topk_reverse_kl_loss",
    "topk_signal_baseline",
]


def _check_shape(name: str, tensor: Tensor, ref_name: str, ref: Tensor) -> None:
    if tensor.shape != ref.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)}, expected {tuple(ref.shape)} (the shape of {ref_name})"
        )


def _check_ndim(name: str, tensor: Tensor, ndim: int, layout: str) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(tensor.shape)}")


def _check_rows(ref_name: str, ref_B_T: Tensor, **others: Tensor) -> None:
    """Raises ValueError unless `ref_B_T` is 2-D and every tensor in `others` has its exact shape."""
    _check_ndim(ref_name, ref_B_T, 2, "[batch, time]")
    for name, tensor in others.items():
        _check_shape(name, tensor, ref_name, ref_B_T)


def _check_num_tokens(num_tokens: float | None) -> None:
    if num_tokens is not None and not num_tokens > 0:
        raise ValueError(f"num_tokens must be > 0, got {num_tokens}")


def _token_count(mask_B_T: Tensor, num_tokens: float | None) -> Tensor | float:
    """The loss normaliser N: `num_tokens` if given, else the trained-token count of this batch.

    The clamp only matters for a batch with no trained token, where the masked sum is 0 anyway: it
    yields a loss of 0 instead of 0/0 = nan.
    """
    if num_tokens is not None:
        return num_tokens
    return mask_B_T.sum().clamp(min=1.0)


def reverse_kl_advantages(
    sampler_logprobs_B_T: Tensor, teacher_logprobs_B_T: Tensor, kl_coef: float
) -> Tensor:
    """Per-token distillation advantage `A_t = −kl_coef·(logp_sampler_t − logp_teacher_t)`.

    `logp_sampler_t − logp_teacher_t` at the token the student sampled is a one-sample Monte-Carlo
    estimate of the reverse KL(student ‖ teacher) at that position, so maximising `A_t` pulls the
    student toward the teacher on the student's own distribution (mode-seeking). The result is a
    constant (detached): it weighs the policy gradient and never receives one.

    Args:
        sampler_logprobs_B_T: [B, T] logprob of each sampled token under the sampling student.
        teacher_logprobs_B_T: [B, T] logprob of the same token under the teacher.
        kl_coef: weight of the reverse-KL term, >= 0.

    Returns:
        [B, T] advantages, not masked (see `opd_advantages` for the masked, combined signal).
    """
    _check_rows("sampler_logprobs_B_T", sampler_logprobs_B_T, teacher_logprobs_B_T=teacher_logprobs_B_T)
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef must be >= 0 (a negative one pushes away from the teacher), got {kl_coef}")
    return (-kl_coef * (sampler_logprobs_B_T - teacher_logprobs_B_T)).detach()


def group_reward_advantages(
    rewards_B: Tensor,
    group_ids_B: Tensor,
    rollout_ids_B: Tensor,
    normalize_by_std: bool,
    eps: float = 1e-6,
) -> Tensor:
    """Task-reward advantage per row: `Â = R − mean(R over the group's rollouts)` (GRPO-style baseline).

    With `normalize_by_std`, `Â = (R − mean) / (std + eps)`, where `std` is the sample standard deviation
    (Bessel-corrected, as GRPO/verl) of the group's rollout rewards. A group with one rollout gets 0.

    Rows are trained segments, but the baseline is over *rollouts*: a group is one prompt's
    `n_rollouts` rollouts, and a multi-turn rollout contributes one row per LLM call, all sharing the
    rollout's reward. Each rollout is counted once in its group's mean and std however many rows it
    has, so a long agentic rollout does not weigh more in the baseline than a one-call rollout.

    Args:
        rewards_B: [B] reward of the rollout each row belongs to (equal across a rollout's rows).
        group_ids_B: [B] id of the prompt group of each row (any integers; equal within a rollout).
        rollout_ids_B: [B] id of the rollout of each row (any integers, unique across groups).
        normalize_by_std: also divide by the group's reward std.
        eps: added to the std so that a group whose rollouts all got the same reward gives 0, not nan.

    Returns:
        [B] advantages, float, detached; equal across the rows of a rollout.
    """
    _check_ndim("rewards_B", rewards_B, 1, "[batch]")
    _check_shape("group_ids_B", group_ids_B, "rewards_B", rewards_B)
    _check_shape("rollout_ids_B", rollout_ids_B, "rewards_B", rewards_B)
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    rewards_B = rewards_B.detach()
    if not rewards_B.is_floating_point():
        rewards_B = rewards_B.to(torch.get_default_dtype())

    # Collapse rows to rollouts (suffix R) so that each rollout counts once, then rollouts to groups (G).
    rollout_ids_R, rollout_index_B = torch.unique(rollout_ids_B, return_inverse=True)
    num_rollouts = rollout_ids_R.numel()
    rewards_R = rewards_B.new_zeros(num_rollouts).scatter_(0, rollout_index_B, rewards_B)
    group_ids_R = group_ids_B.new_zeros(num_rollouts).scatter_(0, rollout_index_B, group_ids_B)
    # scatter_ keeps an arbitrary row's value; if rows of one rollout disagree, the baseline would
    # silently depend on which one, so refuse instead.
    if not torch.equal(rewards_R[rollout_index_B], rewards_B):
        raise ValueError("rewards_B differs between rows of the same rollout (rollout_ids_B)")
    if not torch.equal(group_ids_R[rollout_index_B], group_ids_B):
        raise ValueError("group_ids_B differs between rows of the same rollout (rollout_ids_B)")

    group_ids_G, group_index_R = torch.unique(group_ids_R, return_inverse=True)
    num_groups = group_ids_G.numel()
    count_G = rewards_R.new_zeros(num_groups).index_add_(0, group_index_R, torch.ones_like(rewards_R))
    mean_G = rewards_R.new_zeros(num_groups).index_add_(0, group_index_R, rewards_R) / count_G
    advantages_R = rewards_R - mean_G[group_index_R]
    if normalize_by_std:
        sq_dev_G = rewards_R.new_zeros(num_groups).index_add_(0, group_index_R, advantages_R.square())
        # A group of one has no spread (its advantage is already exactly 0); clamp avoids 0/0.
        std_G = (sq_dev_G / (count_G - 1).clamp(min=1.0)).sqrt()
        advantages_R = advantages_R / (std_G[group_index_R] + eps)
    return advantages_R[rollout_index_B]


def opd_advantages(
    sampler_logprobs_B_T: Tensor,
    teacher_logprobs_B_T: Tensor,
    mask_B_T: Tensor,
    kl_coef: float,
    reward_advantages_B: Tensor | None,
    reward_coef: float,
) -> Tensor:
    """`sampled`'s per-token advantage `A_t = −kl_coef·(logp_sampler_t − logp_teacher_t) + reward_coef·Â_row`.

    The first term is `reverse_kl_advantages`; `Â_row` (from `group_reward_advantages`) is one number per
    row, broadcast over the row's tokens. `A_t` is 0 wherever `mask_B_T` is 0, whatever the logprobs
    hold there, and the result is detached.

    Args:
        sampler_logprobs_B_T: [B, T] logprob of each sampled token under the sampling student.
        teacher_logprobs_B_T: [B, T] logprob of the same token under the teacher.
        mask_B_T: [B, T] 1.0 on trained completion tokens, 0.0 elsewhere.
        kl_coef: weight of the reverse-KL term, >= 0.
        reward_advantages_B: [B] group-baselined reward advantage per row, or None for no reward term
            (then `reward_coef` is unused).
        reward_coef: weight of the reward term.

    Returns:
        [B, T] advantages, 0 at masked positions, detached.
    """
    _check_rows(
        "sampler_logprobs_B_T",
        sampler_logprobs_B_T,
        teacher_logprobs_B_T=teacher_logprobs_B_T,
        mask_B_T=mask_B_T,
    )
    advantages_B_T = reverse_kl_advantages(sampler_logprobs_B_T, teacher_logprobs_B_T, kl_coef)
    if reward_advantages_B is not None:
        if reward_advantages_B.shape != sampler_logprobs_B_T.shape[:1]:
            raise ValueError(
                f"reward_advantages_B has shape {tuple(reward_advantages_B.shape)}, expected "
                f"({sampler_logprobs_B_T.shape[0]},) (one value per row of sampler_logprobs_B_T)"
            )
        advantages_B_T = advantages_B_T + reward_coef * reward_advantages_B.detach()[:, None]
    # where, not a multiply: garbage (inf/nan) at masked positions must not leak as 0·inf = nan.
    return torch.where(mask_B_T > 0, advantages_B_T, 0.0)


def policy_loss(
    learner_logprobs_B_T: Tensor,
    sampler_logprobs_B_T: Tensor,
    advantages_B_T: Tensor,
    mask_B_T: Tensor,
    ratio_cap: float,
    num_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance-sampled policy-gradient loss `−Σ_t mask_t·min(ratio_t, ratio_cap)·A_t / N`.

    `ratio_t = exp(logp_learner_t − logp_sampler_t)` corrects for the learner having drifted from the
    weights that sampled (earlier mini-batches of the step, stale weights, vLLM/learner numerics).
    It is truncated with `torch.clamp(max=ratio_cap)`: a token whose ratio exceeds the cap contributes
    `ratio_cap·A_t` to the loss and **no gradient**. At a kept token the gradient w.r.t.
    `learner_logprobs_B_T` is `−mask_t·ratio_t·A_t / N`; on-policy (ratio 1) the loss is the plain
    policy gradient `−Σ mask·A / N`.

    Args:
        learner_logprobs_B_T: [B, T] logprob of each sampled token under the learner (with grad).
        sampler_logprobs_B_T: [B, T] logprob of the same token under the sampling weights (constant).
        advantages_B_T: [B, T] advantages, e.g. from `opd_advantages`; detached here, so they never
            receive a gradient.
        mask_B_T: [B, T] 1.0 on trained completion tokens, 0.0 elsewhere.
        ratio_cap: truncation cap for the ratio, >= 1 (a cap below 1 would truncate even on-policy
            tokens and silently stop all learning).
        num_tokens: the normaliser N. Pass the trained-token count of the whole optimizer step so that
            its micro-batches sum to one token mean; None uses `mask_B_T.sum()` of this batch.

    Returns:
        `(loss, stats)`: `loss` a 0-dim tensor with grad; `stats` 0-dim detached tensors, computed over
        masked tokens on the *untruncated* ratio: `ratio_mean`, `ratio_max`, and `ratio_truncated_frac`
        (fraction of trained tokens with ratio > ratio_cap). They stay tensors so that a learner looping
        over micro-batches does not force a device sync per micro-batch; call `.item()` when logging.
        With no trained token all three are 0.
    """
    _check_policy_loss_inputs(
        learner_logprobs_B_T, sampler_logprobs_B_T, advantages_B_T, mask_B_T, ratio_cap, num_tokens
    )
    trained_B_T = mask_B_T > 0
    ratio_B_T = _masked_importance_ratio(learner_logprobs_B_T, sampler_logprobs_B_T, trained_B_T)
    truncated_ratio_B_T = torch.clamp(ratio_B_T, max=ratio_cap)
    advantages_B_T = torch.where(trained_B_T, advantages_B_T.detach(), 0.0)
    mask_B_T = mask_B_T.to(ratio_B_T.dtype)
    loss = -(mask_B_T * truncated_ratio_B_T * advantages_B_T).sum() / _token_count(mask_B_T, num_tokens)
    return loss, _ratio_stats(ratio_B_T, trained_B_T, ratio_cap)


def _check_policy_loss_inputs(
    learner_logprobs_B_T: Tensor,
    sampler_logprobs_B_T: Tensor,
    advantages_B_T: Tensor,
    mask_B_T: Tensor,
    ratio_cap: float,
    num_tokens: float | None,
) -> None:
    """Raise ValueError on `policy_loss` inputs of mismatched shapes, a cap below 1 or a bad N."""
    _check_rows(
        "learner_logprobs_B_T",
        learner_logprobs_B_T,
        sampler_logprobs_B_T=sampler_logprobs_B_T,
        advantages_B_T=advantages_B_T,
        mask_B_T=mask_B_T,
    )
    if not ratio_cap >= 1.0:
        raise ValueError(f"ratio_cap must be >= 1, got {ratio_cap}")
    _check_num_tokens(num_tokens)


def _masked_importance_ratio(
    learner_logprobs_B_T: Tensor, sampler_logprobs_B_T: Tensor, trained_B_T: Tensor
) -> Tensor:
    """`exp(logp_learner − logp_sampler)` on trained tokens, exactly 1 elsewhere; grad to the learner only."""
    # Zero the log-ratio at masked positions *before* exp: exp of a garbage difference can overflow to
    # inf, and neither where() nor ·0 afterwards keeps inf out of the backward pass (0·inf = nan).
    log_ratio_B_T = torch.where(trained_B_T, learner_logprobs_B_T - sampler_logprobs_B_T.detach(), 0.0)
    return torch.exp(log_ratio_B_T)


def _ratio_stats(ratio_B_T: Tensor, trained_B_T: Tensor, ratio_cap: float) -> dict[str, Tensor]:
    """`policy_loss`'s detached stats over trained tokens: untruncated ratio mean, max, truncated fraction."""
    with torch.no_grad():
        trained_count = trained_B_T.sum().clamp(min=1)
        return {
            "ratio_mean": torch.where(trained_B_T, ratio_B_T, 0.0).sum() / trained_count,
            # ratio > 0, so 0 at masked positions never wins the max unless nothing is trained.
            "ratio_max": torch.where(trained_B_T, ratio_B_T, 0.0).amax(),
            "ratio_truncated_frac": (trained_B_T & (ratio_B_T > ratio_cap)).sum() / trained_count,
        }


def kl_to_reference(
    learner_logprobs_B_T: Tensor,
    reference_logprobs_B_T: Tensor,
    mask_B_T: Tensor,
    num_tokens: float | None = None,
) -> Tensor:
    """KL(learner ‖ reference), k3 estimator: `Σ_t mask_t·(exp(d_t) − d_t − 1) / N`, `d_t = ref_t − logp_t`.

    k3 (Schulman, "Approximating KL divergence") is unbiased on samples from the learner, and each term
    is >= 0 and exactly 0 where the two logprobs are equal, unlike the plain `logp − ref` estimator.
    Used for the optional `kl_loss_coef · KL(learner ‖ initial student)` term added to `policy_loss`.
    Differentiable w.r.t. `learner_logprobs_B_T`; the reference is a constant.

    Args:
        learner_logprobs_B_T: [B, T] logprob of each sampled token under the learner (with grad).
        reference_logprobs_B_T: [B, T] logprob of the same token under the reference (initial student).
        mask_B_T: [B, T] 1.0 on trained completion tokens, 0.0 elsewhere.
        num_tokens: the normaliser N, as in `policy_loss`; None uses `mask_B_T.sum()`.

    Returns:
        0-dim tensor, >= 0.
    """
    _check_rows(
        "learner_logprobs_B_T",
        learner_logprobs_B_T,
        reference_logprobs_B_T=reference_logprobs_B_T,
        mask_B_T=mask_B_T,
    )
    _check_num_tokens(num_tokens)
    # Same reason as in policy_loss: keep garbage at masked positions out of exp and its backward.
    d_B_T = torch.where(mask_B_T > 0, reference_logprobs_B_T.detach() - learner_logprobs_B_T, 0.0)
    k3_B_T = torch.exp(d_B_T) - d_B_T - 1.0
    mask_B_T = mask_B_T.to(k3_B_T.dtype)
    return (mask_B_T * k3_B_T).sum() / _token_count(mask_B_T, num_tokens)


@torch.no_grad()
def distillation_metrics(
    sampler_logprobs_B_T: Tensor, teacher_logprobs_B_T: Tensor, mask_B_T: Tensor
) -> dict[str, float]:
    """Per-step distillation metrics, token means over `mask_B_T` (0.0 when no token is trained).

    - `reverse_kl`: mean of `logp_sampler − logp_teacher`, the Monte-Carlo reverse KL(student ‖ teacher)
      per token; it goes to 0 as the student matches the teacher.
    - `teacher_logprob`: mean teacher logprob of the student's tokens.
    - `student_logprob`: mean sampler logprob of its own tokens.
    - `entropy`: `−student_logprob`, the Monte-Carlo estimate of the student's per-token entropy.
    - `trained_tokens`: `mask_B_T.sum()`.

    Args:
        sampler_logprobs_B_T: [B, T] logprob of each sampled token under the sampling student.
        teacher_logprobs_B_T: [B, T] logprob of the same token under the teacher.
        mask_B_T: [B, T] 1.0 on trained completion tokens, 0.0 elsewhere.

    Returns:
        Python floats keyed by the names above.
    """
    _check_rows(
        "sampler_logprobs_B_T",
        sampler_logprobs_B_T,
        teacher_logprobs_B_T=teacher_logprobs_B_T,
        mask_B_T=mask_B_T,
    )
    trained_B_T = mask_B_T > 0
    mask_B_T = mask_B_T.to(sampler_logprobs_B_T.dtype)
    count = mask_B_T.sum()
    normaliser = count.clamp(min=1.0)
    student = (mask_B_T * torch.where(trained_B_T, sampler_logprobs_B_T, 0.0)).sum() / normaliser
    teacher = (mask_B_T * torch.where(trained_B_T, teacher_logprobs_B_T, 0.0)).sum() / normaliser
    # One stack + tolist: a single device-to-host copy instead of one sync per metric.
    values = torch.stack([student - teacher, teacher, student, -student, count]).tolist()
    names = ["reverse_kl", "teacher_logprob", "student_logprob", "entropy", "trained_tokens"]
    return dict(zip(names, values, strict=True))


def gather_token_logprobs(logits_B_T_V: Tensor, token_ids_B_T: Tensor, temperature: float = 1.0) -> Tensor:
    """Logprob of given tokens, `log_softmax(logits / temperature)[b, t, token_ids[b, t]]`.

    Use the sampling temperature, so that the learner's logprobs are comparable with the sampler's.
    Output position t is the logprob of `token_ids_B_T[b, t]` under `logits_B_T_V[b, t]`. A causal LM's
    logits at position t predict token t+1, so the caller shifts: for a sequence `ids` pass
    `logits[:, :-1]` with `ids[:, 1:]`. Computed in float32 as `logit − logsumexp(logits)`, which needs no
    second [B, T, V] tensor for the full log-softmax.

    Args:
        logits_B_T_V: [B, T, V] logits (any float dtype).
        token_ids_B_T: [B, T] integer token ids in `[0, V)`.
        temperature: sampling temperature, > 0.

    Returns:
        [B, T] float32 logprobs, differentiable w.r.t. `logits_B_T_V`.
    """
    _check_ndim("logits_B_T_V", logits_B_T_V, 3, "[batch, time, vocab]")
    if token_ids_B_T.shape != logits_B_T_V.shape[:2]:
        raise ValueError(
            f"token_ids_B_T has shape {tuple(token_ids_B_T.shape)}, expected "
            f"{tuple(logits_B_T_V.shape[:2])} (the first two dims of logits_B_T_V)"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return by_tiles(functools.partial(_token_logprobs, temperature=temperature), logits_B_T_V, token_ids_B_T)


def _token_logprobs(logits_B_T_V: Tensor, token_ids_B_T: Tensor, temperature: float) -> Tensor:
    logits_B_T_V = logits_B_T_V.float()
    if temperature != 1.0:  # x / 1 is x: no [B, T, V] copy at the usual temperature
        logits_B_T_V = logits_B_T_V / temperature
    token_logits_B_T = logits_B_T_V.gather(-1, token_ids_B_T.long().unsqueeze(-1)).squeeze(-1)
    return token_logits_B_T - torch.logsumexp(logits_B_T_V, dim=-1)


LOGITS_TILE_BYTES = 64 * 2**20
"""Most float32 logits one tile of `by_tiles` spans (rows of the batch, or positions of one row)."""


def by_tiles(function: Callable[..., Tensor], logits_B_T_V: Tensor, *others_B_T: Tensor) -> Tensor:
    """`function(logits_B_T_V, *others_B_T)` (a per-position function: [b, t, V] and [b, t, ...] in,
    [b, t, ...] out) computed tile by tile when the logits exceed `LOGITS_TILE_BYTES`, each tile under
    activation checkpointing where a gradient is wanted, and the tiles' results concatenated.

    A vocabulary-wide op keeps [B, T, V] intermediates for its backward (a temperature-scaled copy, a
    masked copy, a mask) and makes more while it runs; at a 152k vocabulary one such copy of a job's
    mini-batch (8 rows × 256 positions) is 1.2 GB. Tiled, only the logits themselves are kept, and the
    intermediates of one tile exist at a time (recomputed in the backward pass). The result is the same
    per position (tests/unit/test_loss.py checks it and its gradient to 1e-6).
    """
    from torch.utils.checkpoint import checkpoint

    rows, width, vocab = logits_B_T_V.shape
    positions = max(1, LOGITS_TILE_BYTES // (4 * vocab))
    if rows * width <= positions:
        return function(logits_B_T_V, *others_B_T)
    if positions >= width:  # whole rows a tile
        step = positions // width
        tiles = [(slice(r, r + step), slice(0, width)) for r in range(0, rows, step)]
    else:
        tiles = [
            (slice(r, r + 1), slice(t, t + positions))
            for r in range(rows)
            for t in range(0, width, positions)
        ]
    keep = torch.is_grad_enabled() and logits_B_T_V.requires_grad
    results = []
    for row_slice, position_slice in tiles:
        arguments = [tensor[row_slice, position_slice] for tensor in (logits_B_T_V, *others_B_T)]
        results.append(
            checkpoint(function, *arguments, use_reentrant=False) if keep else function(*arguments)
        )
    if positions >= width:
        return torch.cat(results, dim=0)
    per_row = len(tiles) // rows
    return torch.cat([torch.cat(results[r * per_row : (r + 1) * per_row], dim=1) for r in range(rows)], dim=0)


def full_vocab_reverse_kl(
    student_logits_B_T_V: Tensor, teacher_logits_B_T_V: Tensor, mask_B_T: Tensor
) -> Tensor:
    """Exact reverse KL(student ‖ teacher) per token, summed over the whole vocabulary, masked mean.

    `Σ_{b,t} mask_t · Σ_v p_s(v)·(log p_s(v) − log p_t(v)) / Σ mask`, both distributions at temperature
    1. Unlike `distillation_metrics`' one-sample estimate it has no sampling noise, so it is what to
    compare when asking whether a student moved toward its teacher on fixed sequences. Costs one
    [B, T, V] softmax per model: cheap for small vocabularies, an evaluation tool rather than a loss.

    Args:
        student_logits_B_T_V: [B, T, V] student logits.
        teacher_logits_B_T_V: [B, T, V] teacher logits at the same positions.
        mask_B_T: [B, T] 1.0 on the positions to average, 0.0 elsewhere.

    Returns:
        0-dim float32 tensor, >= 0 (0.0 when the mask is empty).
    """
    _check_ndim("student_logits_B_T_V", student_logits_B_T_V, 3, "[batch, time, vocab]")
    _check_shape("teacher_logits_B_T_V", teacher_logits_B_T_V, "student_logits_B_T_V", student_logits_B_T_V)
    _check_shape("mask_B_T", mask_B_T, "student_logits_B_T_V[..., 0]", student_logits_B_T_V[..., 0])
    student_B_T_V = torch.log_softmax(student_logits_B_T_V.float(), dim=-1)
    teacher_B_T_V = torch.log_softmax(teacher_logits_B_T_V.float(), dim=-1)
    kl_B_T = (student_B_T_V.exp() * (student_B_T_V - teacher_B_T_V)).sum(-1)
    mask_B_T = mask_B_T.float()
    return (mask_B_T * torch.where(mask_B_T > 0, kl_B_T, 0.0)).sum() / mask_B_T.sum().clamp(min=1.0)


# --- distribution-level estimators over the teacher's top-k (the default, topk_forward, among them) -------
#
# Suffix `K`: the teacher's top-k tokens at a position; `J` = K + 1 buckets: those K tokens, then one tail
# bucket holding all remaining probability mass. Both distributions are taken at temperature 1 (vLLM's
# prompt logprobs skip its sampling processors, so the teacher's scores always are). The tail bucket is
# what keeps each side a proper distribution: a divergence over the top-k alone can be lowered by moving
# the student's mass *off* the measured tokens.

LOG_TAIL_FLOOR = -80.0
"""Tail-bucket logprobs are clamped here (exp ≈ 2e-35): with k = vocabulary the true tail is 0 (log −inf),
and 0·(−inf − −inf) would be nan; below the floor the tail carries no gradient, which is what it is worth."""


def _at_least_float32(tensor: Tensor) -> Tensor:
    """float32 for bf16/fp16 inputs (a softmax over a vocabulary needs it); float64 stays (gradcheck)."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def _log1mexp(x: Tensor) -> Tensor:
    """`log(1 − exp(x))` for x <= 0, accurate near 0 and far below it (Mächler 2012's log1mexp)."""
    x = x.clamp(max=0.0)
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _inert_top_k(
    top_ids_B_T_K: Tensor, top_logprobs_B_T_K: Tensor, mask_B_T: Tensor
) -> tuple[Tensor, Tensor]:
    """Top-k ids / logprobs with masked positions replaced by harmless values (id 0, uniform logprobs).

    Masked positions may hold garbage (out-of-range ids, nan); the per-token divergences are computed at
    every position, and a nan there would reach the gradient as 0·nan even though the result is masked.
    """
    trained_B_T_1 = (mask_B_T > 0).unsqueeze(-1)
    ids_B_T_K = torch.where(trained_B_T_1, top_ids_B_T_K.long(), 0)
    uniform = -math.log(top_logprobs_B_T_K.shape[-1] + 1)
    logprobs_B_T_K = torch.where(trained_B_T_1, _at_least_float32(top_logprobs_B_T_K), uniform)
    return ids_B_T_K, logprobs_B_T_K


def teacher_bucket_logprobs(top_logprobs_B_T_K: Tensor) -> Tensor:
    """Teacher logprobs of the J = K + 1 buckets: its top-k logprobs, then `log(1 − Σ_k p_k)` (floored).

    Returns:
        [B, T, K+1] float32, constant (detached).
    """
    top_B_T_K = _at_least_float32(top_logprobs_B_T_K.detach())
    tail_B_T = _log1mexp(torch.logsumexp(top_B_T_K, dim=-1)).clamp(min=LOG_TAIL_FLOOR)
    return torch.cat([top_B_T_K, tail_B_T.unsqueeze(-1)], dim=-1)


def student_bucket_logprobs(logits_B_T_V: Tensor, top_ids_B_T_K: Tensor) -> Tensor:
    """Student logprobs (temperature 1) of the J = K + 1 buckets of the teacher's top-k ids, differentiable.

    The tail is `logsumexp(logits outside the top-k) − logsumexp(all logits)`, computed from the logits
    rather than as `log(1 − Σ_k p_k)`, which loses the tail to cancellation when the top-k holds nearly
    all the mass. The ids of one position must be distinct (vLLM's top-k are).

    Args:
        logits_B_T_V: [B, T, V] student logits at the positions the teacher scored.
        top_ids_B_T_K: [B, T, K] the teacher's top-k token ids.

    Returns:
        [B, T, K+1] float32 logprobs, differentiable w.r.t. `logits_B_T_V`.
    """
    _check_ndim("logits_B_T_V", logits_B_T_V, 3, "[batch, time, vocab]")
    if top_ids_B_T_K.dim() != 3 or top_ids_B_T_K.shape[:2] != logits_B_T_V.shape[:2]:
        raise ValueError(
            f"top_ids_B_T_K has shape {tuple(top_ids_B_T_K.shape)}, expected "
            f"({', '.join(map(str, logits_B_T_V.shape[:2]))}, K) (the first two dims of logits_B_T_V)"
        )
    return by_tiles(_bucket_logprobs, logits_B_T_V, top_ids_B_T_K)


def _bucket_logprobs(logits_B_T_V: Tensor, top_ids_B_T_K: Tensor) -> Tensor:
    logits_B_T_V = _at_least_float32(logits_B_T_V)
    top_ids_B_T_K = top_ids_B_T_K.long()
    log_normaliser_B_T_1 = torch.logsumexp(logits_B_T_V, dim=-1, keepdim=True)
    top_B_T_K = logits_B_T_V.gather(-1, top_ids_B_T_K) - log_normaliser_B_T_1
    in_top_B_T_V = torch.zeros_like(logits_B_T_V, dtype=torch.bool).scatter_(-1, top_ids_B_T_K, True)
    # The most negative finite float, not −inf: logsumexp over an all −inf row has a nan gradient.
    outside_B_T_V = logits_B_T_V.masked_fill(in_top_B_T_V, torch.finfo(logits_B_T_V.dtype).min)
    tail_B_T_1 = torch.logsumexp(outside_B_T_V, dim=-1, keepdim=True) - log_normaliser_B_T_1
    return torch.cat([top_B_T_K, tail_B_T_1.clamp(min=LOG_TAIL_FLOOR)], dim=-1)


def bucket_reverse_kl(student_B_T_J: Tensor, teacher_B_T_J: Tensor) -> Tensor:
    """Per-position reverse KL(student ‖ teacher), `Σ_j p_s,j·(log p_s,j − log p_t,j)`: [B, T]."""
    return (student_B_T_J.exp() * (student_B_T_J - teacher_B_T_J)).sum(-1)


def bucket_forward_kl(student_B_T_J: Tensor, teacher_B_T_J: Tensor) -> Tensor:
    """Per-position forward KL(teacher ‖ student), `Σ_j p_t,j·(log p_t,j − log p_s,j)`: [B, T]."""
    return (teacher_B_T_J.exp() * (teacher_B_T_J - student_B_T_J)).sum(-1)


def bucket_jsd(student_B_T_J: Tensor, teacher_B_T_J: Tensor, beta: float) -> Tensor:
    """Per-position generalized JSD of GKD (Agarwal et al. 2024) over buckets, [B, T].

    `JSD_β = β·KL(p_t ‖ m) + (1 − β)·KL(p_s ‖ m)` with the mixture `m = β·p_t + (1 − β)·p_s`; it tends to
    the forward KL's behaviour as β → 0 and the reverse KL's as β → 1 (use `bucket_forward_kl` /
    `bucket_reverse_kl` for the end points, where the mixture degenerates).
    """
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    mixture_B_T_J = torch.logsumexp(
        torch.stack([teacher_B_T_J + math.log(beta), student_B_T_J + math.log(1.0 - beta)]), dim=0
    )
    to_teacher_B_T = (teacher_B_T_J.exp() * (teacher_B_T_J - mixture_B_T_J)).sum(-1)
    to_student_B_T = (student_B_T_J.exp() * (student_B_T_J - mixture_B_T_J)).sum(-1)
    return beta * to_teacher_B_T + (1.0 - beta) * to_student_B_T


def _check_top_k_inputs(
    logits_B_T_V: Tensor, top_ids_B_T_K: Tensor, top_logprobs_B_T_K: Tensor, mask_B_T: Tensor
) -> None:
    _check_ndim("logits_B_T_V", logits_B_T_V, 3, "[batch, time, vocab]")
    _check_shape("mask_B_T", mask_B_T, "logits_B_T_V[..., 0]", logits_B_T_V[..., 0])
    _check_ndim("top_ids_B_T_K", top_ids_B_T_K, 3, "[batch, time, k]")
    _check_shape("top_logprobs_B_T_K", top_logprobs_B_T_K, "top_ids_B_T_K", top_ids_B_T_K)


def _masked_mean(values_B_T: Tensor, mask_B_T: Tensor, num_tokens: float | None) -> Tensor:
    mask_B_T = mask_B_T.to(values_B_T.dtype)
    return (mask_B_T * torch.where(mask_B_T > 0, values_B_T, 0.0)).sum() / _token_count(mask_B_T, num_tokens)


def _top_k_loss(
    divergence: Callable[[Tensor, Tensor], Tensor],
    logits_B_T_V: Tensor,
    top_ids_B_T_K: Tensor,
    top_logprobs_B_T_K: Tensor,
    mask_B_T: Tensor,
    num_tokens: float | None,
) -> tuple[Tensor, Tensor]:
    _check_top_k_inputs(logits_B_T_V, top_ids_B_T_K, top_logprobs_B_T_K, mask_B_T)
    _check_num_tokens(num_tokens)
    ids_B_T_K, logprobs_B_T_K = _inert_top_k(top_ids_B_T_K, top_logprobs_B_T_K, mask_B_T)
    student_B_T_J = student_bucket_logprobs(logits_B_T_V, ids_B_T_K)
    teacher_B_T_J = teacher_bucket_logprobs(logprobs_B_T_K)
    per_token_B_T = torch.where(mask_B_T > 0, divergence(student_B_T_J, teacher_B_T_J), 0.0)
    return _masked_mean(per_token_B_T, mask_B_T, num_tokens), per_token_B_T.detach()


def topk_reverse_kl_loss(
    logits_B_T_V: Tensor,
    top_ids_B_T_K: Tensor,
    top_logprobs_B_T_K: Tensor,
    mask_B_T: Tensor,
    num_tokens: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Reverse KL(student ‖ teacher) over the teacher's top-k + one tail bucket, masked token mean.

    `L = Σ_{b,t} mask_t · Σ_j p_s,j·(log p_s,j − log p_t,j) / N` over the J = K + 1 buckets
    (`student_bucket_logprobs`, `teacher_bucket_logprobs`). Differentiated directly through the student's
    logits: no sampling, no importance ratio. With K = V it is the exact full-vocabulary reverse KL
    (`full_vocab_reverse_kl`).

    Args:
        logits_B_T_V: [B, T, V] student logits (temperature 1) at the scored positions.
        top_ids_B_T_K: [B, T, K] the teacher's top-k ids at those positions.
        top_logprobs_B_T_K: [B, T, K] their teacher logprobs (temperature 1).
        mask_B_T: [B, T] 1.0 on trained completion tokens, 0.0 elsewhere (never read there).
        num_tokens: the normaliser N, as in `policy_loss`; None uses `mask_B_T.sum()`.

    Returns:
        `(loss, per_token_B_T)`: the 0-dim loss with grad, and the detached per-position divergence
        (0 at masked positions), for metrics.
    """
    return _top_k_loss(
        bucket_reverse_kl, logits_B_T_V, top_ids_B_T_K, top_logprobs_B_T_K, mask_B_T, num_tokens
    )


def topk_forward_kl_loss(
    logits_B_T_V: Tensor,
    top_ids_B_T_K: Tensor,
    top_logprobs_B_T_K: Tensor,
    mask_B_T: Tensor,
    num_tokens: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Forward KL(teacher ‖ student) over the teacher's top-k + one tail bucket, masked token mean.

    `L = Σ mask_t · Σ_j p_t,j·(log p_t,j − log p_s,j) / N` (mass-covering; same buckets, arguments and
    returns as `topk_reverse_kl_loss`).
    """
    return _top_k_loss(
        bucket_forward_kl, logits_B_T_V, top_ids_B_T_K, top_logprobs_B_T_K, mask_B_T, num_tokens
    )


def topk_jsd_loss(
    logits_B_T_V: Tensor,
    top_ids_B_T_K: Tensor,
    top_logprobs_B_T_K: Tensor,
    mask_B_T: Tensor,
    beta: float,
    num_tokens: float | None = None,
) -> tuple[Tensor, Tensor]:
    """GKD's generalized JSD (`bucket_jsd`, β in (0, 1)) over the teacher's top-k + one tail bucket.

    Same buckets, arguments and returns as `topk_reverse_kl_loss`, plus `beta`.
    """
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    jsd = functools.partial(bucket_jsd, beta=beta)
    return _top_k_loss(jsd, logits_B_T_V, top_ids_B_T_K, top_logprobs_B_T_K, mask_B_T, num_tokens)


@torch.no_grad()
def topk_signal_baseline(
    logits_B_T_V: Tensor, top_ids_B_T_K: Tensor, top_logprobs_B_T_K: Tensor, mask_B_T: Tensor
) -> Tensor:
    """Per-position baseline `b_t` for the sampled signal `f(y) = logp_s(y) − logp_t(y)`, from the top-k.

    Any `b_t` that depends on the context but not on the sampled token `y_t` leaves the policy gradient
    `E[(f(y) − b)·∇log p_s(y)]` unbiased, because `E[∇log p_s(y)] = 0`. This one is the variance-minimising
    constant for the gradient w.r.t. the logits, `g(y) = e_y − p_s`:
    `b* = E[f(y)·|g(y)|²] / E[|g(y)|²]`, with `|g(y)|² = 1 − 2·p_y + S`, `S = Σ_v p_v²`, and
    `E[|g|²] = 1 − S`. (For the LM-head weights the gradient is `g(y)·hᵀ` with `h` independent of `y`, so
    there it is the exact optimum.) `f` is known exactly on the teacher's top-k; a tail token gets its
    bucket's `log p_s,tail − log p_t,tail`, with the tail's weight `Σ_{v∉top-k} p_v·|g(v)|²` exact. With
    k = V it is `b*` itself and can only lower the variance; with a small k the tail's one shared value
    can miss `b*` by more than `|b*|` and raise it a little (k = 1 in tests/unit/test_topk_loss.py). The
    plain mean `E[f]` (the KL) is not a safe choice either: at positions where `f` is large for tokens
    with a small gradient it raises the variance.

    Returns:
        [B, T] detached, 0 at masked positions.
    """
    _check_top_k_inputs(logits_B_T_V, top_ids_B_T_K, top_logprobs_B_T_K, mask_B_T)
    ids_B_T_K, logprobs_B_T_K = _inert_top_k(top_ids_B_T_K, top_logprobs_B_T_K, mask_B_T)
    logits_B_T_V = _at_least_float32(logits_B_T_V)
    squared_mass_B_T = by_tiles(_squared_mass, logits_B_T_V)
    student_B_T_J = student_bucket_logprobs(logits_B_T_V, ids_B_T_K)
    signal_B_T_J = student_B_T_J - teacher_bucket_logprobs(logprobs_B_T_K)
    top_p_B_T_K = student_B_T_J[..., :-1].exp()
    top_weight_B_T_K = top_p_B_T_K * (1.0 - 2.0 * top_p_B_T_K + squared_mass_B_T.unsqueeze(-1))
    tail_p_B_T = (1.0 - top_p_B_T_K.sum(-1)).clamp(min=0.0)
    tail_squared_mass_B_T = (squared_mass_B_T - top_p_B_T_K.square().sum(-1)).clamp(min=0.0)
    tail_weight_B_T = tail_p_B_T * (1.0 + squared_mass_B_T) - 2.0 * tail_squared_mass_B_T
    numerator_B_T = (signal_B_T_J[..., :-1] * top_weight_B_T_K).sum(-1) + signal_B_T_J[
        ..., -1
    ] * tail_weight_B_T
    # 1 − S → 0 only for a near-deterministic student, whose every gradient g(y) is then ~0 as well.
    baseline_B_T = numerator_B_T / (1.0 - squared_mass_B_T).clamp(min=1e-6)
    return torch.where(mask_B_T > 0, baseline_B_T, 0.0)


def _squared_mass(logits_B_T_V: Tensor) -> Tensor:
    """`Σ_v p_v²` per position."""
    return torch.softmax(logits_B_T_V, dim=-1).square().sum(-1)


def sampled_baseline_advantages(
    sampler_logprobs_B_T: Tensor,
    teacher_logprobs_B_T: Tensor,
    baseline_B_T: Tensor,
    mask_B_T: Tensor,
    kl_coef: float,
) -> Tensor:
    """Per-token distillation advantage with a baseline: `A_t = −kl_coef·(logp_s_t − logp_t_t − b_t)`.

    `b_t` from `topk_signal_baseline`. Detached, 0 at masked positions; add the reward term with
    `add_reward_advantages`.
    """
    _check_rows(
        "sampler_logprobs_B_T",
        sampler_logprobs_B_T,
        teacher_logprobs_B_T=teacher_logprobs_B_T,
        baseline_B_T=baseline_B_T,
        mask_B_T=mask_B_T,
    )
    advantages_B_T = reverse_kl_advantages(sampler_logprobs_B_T, teacher_logprobs_B_T, kl_coef)
    advantages_B_T = advantages_B_T + kl_coef * baseline_B_T.detach()
    return torch.where(mask_B_T > 0, advantages_B_T, 0.0)


def add_reward_advantages(
    advantages_B_T: Tensor, mask_B_T: Tensor, reward_advantages_B: Tensor | None, reward_coef: float
) -> Tensor:
    """`advantages_B_T + reward_coef·Â_row` on trained tokens, 0 elsewhere, detached (as in `opd_advantages`).

    Used by the estimators whose distillation term is not an advantage (top-k losses: pass zeros) or
    carries a baseline (`sampled_baseline_advantages`).
    """
    _check_rows("advantages_B_T", advantages_B_T, mask_B_T=mask_B_T)
    advantages_B_T = advantages_B_T.detach()
    if reward_advantages_B is not None:
        if reward_advantages_B.shape != advantages_B_T.shape[:1]:
            raise ValueError(
                f"reward_advantages_B has shape {tuple(reward_advantages_B.shape)}, expected "
                f"({advantages_B_T.shape[0]},) (one value per row of advantages_B_T)"
            )
        advantages_B_T = advantages_B_T + reward_coef * reward_advantages_B.detach()[:, None]
    return torch.where(mask_B_T > 0, advantages_B_T, 0.0)


@torch.no_grad()
def topk_metrics(
    logits_B_T_V: Tensor, top_ids_B_T_K: Tensor, top_logprobs_B_T_K: Tensor, mask_B_T: Tensor
) -> dict[str, Tensor]:
    """Token means over `mask_B_T` of how much the teacher's top-k covers (0.0 when nothing is trained).

    - `teacher_topk_mass`: `Σ_k p_t,k`, the teacher's own mass on its top-k (low: k too small for it).
    - `student_topk_mass`: the student's mass on the teacher's top-k (low: the pair disagree).

    Returns 0-dim detached tensors (no device sync per micro-batch; `.item()` when logging).
    """
    _check_top_k_inputs(logits_B_T_V, top_ids_B_T_K, top_logprobs_B_T_K, mask_B_T)
    ids_B_T_K, logprobs_B_T_K = _inert_top_k(top_ids_B_T_K, top_logprobs_B_T_K, mask_B_T)
    student_B_T_J = student_bucket_logprobs(logits_B_T_V, ids_B_T_K)
    return {
        "teacher_topk_mass": _masked_mean(logprobs_B_T_K.exp().sum(-1), mask_B_T, None),
        "student_topk_mass": _masked_mean(student_B_T_J[..., :-1].exp().sum(-1), mask_B_T, None),
    }


@torch.no_grad()
def signal_std(signal_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """Standard deviation (population) of a per-token signal over trained tokens; 0 with < 1 token."""
    _check_rows("signal_B_T", signal_B_T, mask_B_T=mask_B_T)
    signal_B_T = torch.where(mask_B_T > 0, _at_least_float32(signal_B_T), 0.0)
    mean = _masked_mean(signal_B_T, mask_B_T, None)
    return _masked_mean((signal_B_T - mean).square(), mask_B_T, None).sqrt()
