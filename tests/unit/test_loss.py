"""Unit tests for the distillation signal and the learner loss (`learner.loss`), on hand-made numbers."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from opd_trainer.learner.loss import (
    distillation_metrics,
    full_vocab_reverse_kl,
    gather_token_logprobs,
    group_reward_advantages,
    kl_to_reference,
    opd_advantages,
    policy_loss,
    reverse_kl_advantages,
)

LN2 = math.log(2.0)
NAN = float("nan")
INF = float("inf")


def _t(rows: list[list[float]] | list[float], requires_grad: bool = False) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32, requires_grad=requires_grad)


def _grad(loss: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, tensor)
    return grad


# --- masking -----------------------------------------------------------------------------------------

# One row: prompt, completion, tool result, tool result, completion, padding.
MASK_1x6 = _t([[0, 1, 0, 0, 1, 0]])
TRAINED = MASK_1x6.bool()


def _fill_masked(clean: torch.Tensor, garbage: list[float]) -> torch.Tensor:
    out = clean.clone()
    out[~TRAINED] = torch.tensor(garbage)
    return out


def test_masked_positions_do_not_change_loss_or_gradient() -> None:
    learner = _t([[0.0, -1.0, 0.0, 0.0, -2.0, 0.0]])
    sampler = _t([[0.0, -1.5, 0.0, 0.0, -1.5, 0.0]])
    teacher = _t([[0.0, -0.5, 0.0, 0.0, -3.0, 0.0]])
    reference = _t([[0.0, -1.2, 0.0, 0.0, -2.5, 0.0]])

    def run(learner_: torch.Tensor, sampler_: torch.Tensor, teacher_: torch.Tensor, reference_: torch.Tensor):
        learner_ = learner_.clone().requires_grad_(True)
        advantages = opd_advantages(sampler_, teacher_, MASK_1x6, 1.0, torch.tensor([0.5]), 2.0)
        loss, stats = policy_loss(learner_, sampler_, advantages, MASK_1x6, ratio_cap=5.0)
        kl = kl_to_reference(learner_, reference_, MASK_1x6)
        grad = _grad(loss + 0.1 * kl, learner_)
        metrics = distillation_metrics(sampler_, teacher_, MASK_1x6)
        return loss.detach(), kl.detach(), grad, advantages, stats, metrics

    clean = run(learner, sampler, teacher, reference)
    # Large finite, inf and nan at prompt / tool-result / padding positions: none may leak.
    dirty = run(
        _fill_masked(learner, [50.0, -80.0, NAN, 7.0]),
        _fill_masked(sampler, [-90.0, 60.0, 3.0, -INF]),
        _fill_masked(teacher, [-INF, NAN, 100.0, -INF]),
        _fill_masked(reference, [INF, -100.0, NAN, 40.0]),
    )
    for a, b in zip(clean[:4], dirty[:4], strict=True):
        assert_close(a, b)
    for key in clean[4]:
        assert_close(clean[4][key], dirty[4][key])
    assert clean[5] == dirty[5]

    loss, _, grad, advantages, _, _ = dirty
    assert torch.isfinite(loss)
    assert torch.equal(grad[~TRAINED], torch.zeros(4))
    assert torch.all(grad[TRAINED] != 0)
    assert torch.equal(advantages[~TRAINED], torch.zeros(4))


# --- reverse-KL and combined advantages --------------------------------------------------------------


def test_reverse_kl_advantages_hand_example() -> None:
    sampler = _t([[-1.0, -2.0, -0.5]], requires_grad=True)
    teacher = _t([[-1.5, -1.0, -0.5]], requires_grad=True)
    # −kl_coef·(sampler − teacher) with sampler − teacher = [0.5, −1, 0]
    assert_close(reverse_kl_advantages(sampler, teacher, 1.0), _t([[-0.5, 1.0, 0.0]]))
    advantages = reverse_kl_advantages(sampler, teacher, 0.5)
    assert_close(advantages, _t([[-0.25, 0.5, 0.0]]))
    assert not advantages.requires_grad


def test_opd_advantages_adds_weighted_reward_per_row_and_masks() -> None:
    sampler = _t([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    teacher = _t([[-1.5, -1.0, -0.5], [-2.0, -1.0, -1.0]])
    mask = _t([[0, 1, 1], [1, 1, 0]])
    advantages = opd_advantages(sampler, teacher, mask, 0.5, torch.tensor([1.0, -2.0]), 0.25)
    # KL part: row0 [−0.25, 0.5, 0], row1 [−0.5, 0, 0]; reward part 0.25·[1, −2] = [0.25, −0.5] per row.
    assert_close(advantages, _t([[0.0, 0.75, 0.25], [-1.0, -0.5, 0.0]]))


def test_student_equal_to_teacher_gives_zero_advantage_and_zero_gradient() -> None:
    sampler = _t([[-0.3, -1.7, -2.2, -0.1], [-0.9, -0.4, -5.0, -1.1]])
    mask = _t([[0, 1, 1, 1], [1, 1, 1, 0]])
    advantages = opd_advantages(sampler, sampler.clone(), mask, 1.0, None, 1.0)
    assert torch.equal(advantages, torch.zeros_like(sampler))
    learner = (sampler + 0.3).requires_grad_(True)
    loss, _ = policy_loss(learner, sampler, advantages, mask, ratio_cap=10.0)
    assert loss.item() == 0.0
    assert torch.equal(_grad(loss, learner), torch.zeros_like(sampler))


# --- group reward baseline ---------------------------------------------------------------------------


def test_group_baseline_two_prompts_three_rollouts() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 4.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    rollouts = torch.arange(6)
    # group 0: mean 0.5; group 1: mean 2.
    assert_close(
        group_reward_advantages(rewards, groups, rollouts, normalize_by_std=False),
        torch.tensor([0.5, -0.5, 0.0, 0.0, 2.0, -2.0]),
    )
    # Sample std: group 0 sqrt(0.5 / 2) = 0.5, group 1 sqrt(8 / 2) = 2.
    assert_close(
        group_reward_advantages(rewards, groups, rollouts, normalize_by_std=True, eps=0.0),
        torch.tensor([1.0, -1.0, 0.0, 0.0, 1.0, -1.0]),
    )


def test_group_baseline_counts_a_multi_row_rollout_once() -> None:
    # Rollout 7 (reward 1) has two rows; rollouts 8 and 9 (reward 0) one each. Ids need not be dense.
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    groups = torch.tensor([5, 5, 5, 5])
    rollouts = torch.tensor([7, 8, 7, 9])
    # Over rollouts the mean is 1/3 (over rows it would be 1/2).
    assert_close(
        group_reward_advantages(rewards, groups, rollouts, normalize_by_std=False),
        torch.tensor([2 / 3, -1 / 3, 2 / 3, -1 / 3]),
    )
    # Sample std over rollouts [1, 0, 0]: sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3).
    std = math.sqrt(1 / 3)
    assert_close(
        group_reward_advantages(rewards, groups, rollouts, normalize_by_std=True, eps=0.0),
        torch.tensor([2 / 3, -1 / 3, 2 / 3, -1 / 3]) / std,
    )


def test_group_of_one_and_constant_group_give_zero() -> None:
    rewards = torch.tensor([3.0, 3.0, 0.7, 2.0, 2.0])
    groups = torch.tensor([0, 0, 1, 2, 2])
    rollouts = torch.tensor([0, 0, 1, 2, 3])  # group 0: one rollout over 2 rows; group 2: equal rewards
    for normalize in (False, True):
        advantages = group_reward_advantages(rewards, groups, rollouts, normalize_by_std=normalize)
        assert torch.equal(advantages, torch.zeros(5))


def test_group_baseline_rejects_rows_of_one_rollout_that_disagree() -> None:
    with pytest.raises(ValueError, match="rewards_B"):
        group_reward_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([4, 4]), False)
    with pytest.raises(ValueError, match="group_ids_B"):
        group_reward_advantages(torch.tensor([1.0, 1.0]), torch.tensor([0, 1]), torch.tensor([4, 4]), False)


# --- policy loss -------------------------------------------------------------------------------------

# 2 rows × 4 tokens: row 0 has a prompt token, row 1 a prompt token and padding.
PL_MASK = _t([[0, 1, 1, 1], [0, 1, 1, 0]])
PL_SAMPLER = _t([[-1.0, -1.0, -2.0, -0.5], [-1.0, -3.0, -1.0, -1.0]])
PL_LOG_RATIO = _t([[0.0, LN2, 0.0, -LN2], [0.0, 0.0, math.log(1.5), 0.0]])  # ratios 2, 1, .5 | 1, 1.5
PL_ADVANTAGES = _t([[9.0, 1.0, -1.0, 2.0], [9.0, 3.0, 2.0, 9.0]])


def test_policy_loss_hand_example_value_gradient_and_stats() -> None:
    learner = (PL_SAMPLER + PL_LOG_RATIO).requires_grad_(True)
    advantages = PL_ADVANTAGES.clone().requires_grad_(True)
    sampler = PL_SAMPLER.clone().requires_grad_(True)
    loss, stats = policy_loss(learner, sampler, advantages, PL_MASK, ratio_cap=10.0)
    # Σ mask·ratio·A = 2·1 + 1·(−1) + 0.5·2 + 1·3 + 1.5·2 = 8 over N = 5 tokens.
    assert_close(loss, torch.tensor(-8.0 / 5))
    loss.backward()
    # d/dlogp_learner of −ratio·A/N is −ratio·A/N.
    assert_close(learner.grad, _t([[0.0, -2.0, 1.0, -1.0], [0.0, -3.0, -3.0, 0.0]]) / 5)
    assert advantages.grad is None
    assert sampler.grad is None
    assert_close(stats["ratio_mean"], torch.tensor(6.0 / 5))
    assert_close(stats["ratio_max"], torch.tensor(2.0))
    assert stats["ratio_truncated_frac"].item() == 0.0
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())


def test_policy_loss_with_explicit_num_tokens() -> None:
    learner = (PL_SAMPLER + PL_LOG_RATIO).requires_grad_(True)
    loss, _ = policy_loss(learner, PL_SAMPLER, PL_ADVANTAGES, PL_MASK, ratio_cap=10.0, num_tokens=16.0)
    assert_close(loss, torch.tensor(-8.0 / 16))
    assert_close(_grad(loss, learner), _t([[0.0, -2.0, 1.0, -1.0], [0.0, -3.0, -3.0, 0.0]]) / 16)


def test_policy_loss_truncates_ratio_at_cap_without_gradient() -> None:
    sampler = _t([[-1.0, -1.0, -1.0]])
    learner = (sampler + _t([[math.log(3.0), math.log(0.5), 0.0]])).requires_grad_(True)
    advantages = _t([[1.0, 2.0, 5.0]])
    mask = _t([[1, 1, 0]])
    loss, stats = policy_loss(learner, sampler, advantages, mask, ratio_cap=2.0)
    # ratio 3 is truncated to 2: −(2·1 + 0.5·2) / 2.
    assert_close(loss, torch.tensor(-1.5))
    assert_close(_grad(loss, learner), _t([[0.0, -0.5, 0.0]]))
    assert_close(stats["ratio_truncated_frac"], torch.tensor(0.5))
    assert_close(stats["ratio_max"], torch.tensor(3.0))
    assert_close(stats["ratio_mean"], torch.tensor(1.75))


def test_policy_loss_on_policy_is_minus_mean_advantage() -> None:
    generator = torch.Generator().manual_seed(0)
    sampler = -torch.rand(3, 5, generator=generator) * 4
    advantages = torch.randn(3, 5, generator=generator)
    mask = _t([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 0, 1, 0]])
    learner = sampler.clone().requires_grad_(True)
    loss, stats = policy_loss(learner, sampler, advantages, mask, ratio_cap=2.0)
    assert_close(loss, -(advantages * mask).sum() / mask.sum())
    assert_close(_grad(loss, learner), -(advantages * mask) / mask.sum())
    assert stats["ratio_mean"].item() == 1.0
    assert stats["ratio_max"].item() == 1.0
    assert stats["ratio_truncated_frac"].item() == 0.0


def test_policy_loss_with_no_trained_token_is_zero() -> None:
    learner = _t([[-1.0, -2.0]], requires_grad=True)
    loss, stats = policy_loss(learner, _t([[-1.0, 5.0]]), _t([[1.0, 1.0]]), _t([[0, 0]]), ratio_cap=2.0)
    assert loss.item() == 0.0
    assert all(v.item() == 0.0 for v in stats.values())


# --- KL to the reference -----------------------------------------------------------------------------


def test_kl_to_reference_k3() -> None:
    learner = _t([[-0.7, -2.3]], requires_grad=True)
    mask = _t([[1, 1]])
    kl = kl_to_reference(learner, learner.detach().clone(), mask)
    assert kl.item() == 0.0
    assert torch.equal(_grad(kl, learner), torch.zeros(1, 2))

    assert kl_to_reference(learner, _t([[-0.2, -3.0]]), mask).item() > 0
    assert kl_to_reference(learner, _t([[-1.5, -1.0]]), mask).item() > 0

    # One trained token with ref − logp = 1: e − 1 − 1, gradient 1 − e; the second token is masked.
    learner = _t([[-2.0, 4.0]], requires_grad=True)
    kl = kl_to_reference(learner, _t([[-1.0, -9.0]]), _t([[1, 0]]))
    assert_close(kl, torch.tensor(math.e - 2.0))
    assert_close(_grad(kl, learner), _t([[1.0 - math.e, 0.0]]))
    kl = kl_to_reference(learner, _t([[-1.0, -9.0]]), _t([[1, 0]]), num_tokens=4.0)
    assert_close(kl, torch.tensor((math.e - 2.0) / 4))


# --- metrics and logprob gathering -------------------------------------------------------------------


def test_distillation_metrics_hand_example() -> None:
    sampler = _t([[-1.0, -2.0, 7.0], [-0.5, NAN, 7.0]])
    teacher = _t([[-0.5, -1.0, -INF], [-1.5, 7.0, 7.0]])
    mask = _t([[1, 1, 0], [1, 0, 0]])
    metrics = distillation_metrics(sampler, teacher, mask)
    assert metrics == pytest.approx(
        {
            "reverse_kl": (-0.5 - 1.0 + 1.0) / 3,
            "teacher_logprob": -3.0 / 3,
            "student_logprob": -3.5 / 3,
            "entropy": 3.5 / 3,
            "trained_tokens": 3.0,
        }
    )
    assert all(type(v) is float for v in metrics.values())


def test_gather_token_logprobs_matches_manual_log_softmax() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 5, generator=generator, requires_grad=True)
    ids = torch.tensor([[0, 4, 2], [3, 3, 1]])
    expected = torch.log_softmax(logits.detach() / 0.7, dim=-1).gather(-1, ids[..., None]).squeeze(-1)
    got = gather_token_logprobs(logits, ids, temperature=0.7)
    assert_close(got, expected)
    got.sum().backward()
    assert logits.grad is not None

    # Hand value: logits [0, ln 3] give p(token 1) = 3/4; at temperature 2, [0, ln 3 / 2] give √3/(1+√3).
    hand = _t([[[0.0, math.log(3.0)]]])
    assert_close(gather_token_logprobs(hand, torch.tensor([[1]])), _t([[math.log(0.75)]]))
    assert_close(
        gather_token_logprobs(hand, torch.tensor([[1]]), temperature=2.0),
        _t([[math.log(math.sqrt(3) / (1 + math.sqrt(3)))]]),
    )
    assert gather_token_logprobs(hand.bfloat16(), torch.tensor([[1]])).dtype == torch.float32


# --- argument checks ---------------------------------------------------------------------------------


def test_bad_arguments_raise_value_error_naming_them() -> None:
    x = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="ratio_cap"):
        policy_loss(x, x, x, mask, ratio_cap=-1.0)
    with pytest.raises(ValueError, match="mask_B_T"):
        policy_loss(x, x, x, torch.ones(2, 4), ratio_cap=2.0)
    with pytest.raises(ValueError, match="learner_logprobs_B_T"):
        policy_loss(torch.zeros(6), x, x, mask, ratio_cap=2.0)
    with pytest.raises(ValueError, match="num_tokens"):
        policy_loss(x, x, x, mask, ratio_cap=2.0, num_tokens=0.0)
    with pytest.raises(ValueError, match="teacher_logprobs_B_T"):
        reverse_kl_advantages(x, torch.zeros(3, 2), 1.0)
    with pytest.raises(ValueError, match="kl_coef"):
        reverse_kl_advantages(x, x, -0.1)
    with pytest.raises(ValueError, match="reward_advantages_B"):
        opd_advantages(x, x, mask, 1.0, torch.zeros(3), 1.0)
    with pytest.raises(ValueError, match="reference_logprobs_B_T"):
        kl_to_reference(x, torch.zeros(2, 2), mask)
    with pytest.raises(ValueError, match="mask_B_T"):
        distillation_metrics(x, x, torch.ones(1, 3))
    with pytest.raises(ValueError, match="rollout_ids_B"):
        group_reward_advantages(torch.zeros(3), torch.zeros(3), torch.zeros(2), False)
    with pytest.raises(ValueError, match="rewards_B"):
        group_reward_advantages(torch.zeros(3, 1), torch.zeros(3, 1), torch.zeros(3, 1), False)
    with pytest.raises(ValueError, match="token_ids_B_T"):
        gather_token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        gather_token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), temperature=0.0)


# --- full_vocab_reverse_kl ---------------------------------------------------------------------------


def test_full_vocab_reverse_kl_hand_computed() -> None:
    # Position 0: student (1/2, 1/2), teacher (1/4, 3/4): KL = 1/2·ln 2 + 1/2·ln(2/3).
    # Position 1: identical distributions, KL 0. Position 2: masked, garbage logits.
    student = torch.log(_t([[[0.5, 0.5], [0.3, 0.7], [1.0, 1.0]]]))
    teacher = torch.log(_t([[[0.25, 0.75], [0.3, 0.7], [NAN, INF]]]))
    mask = _t([[1, 1, 0]])
    expected = (0.5 * LN2 + 0.5 * math.log(2 / 3)) / 2
    assert full_vocab_reverse_kl(student, teacher, mask).item() == pytest.approx(expected, abs=1e-6)


def test_full_vocab_reverse_kl_is_zero_for_equal_models_and_empty_masks() -> None:
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    assert full_vocab_reverse_kl(logits, logits, torch.ones(2, 3)).item() == pytest.approx(0.0, abs=1e-6)
    assert full_vocab_reverse_kl(logits, logits + 1.0, torch.zeros(2, 3)).item() == 0.0


def test_full_vocab_reverse_kl_checks_shapes() -> None:
    with pytest.raises(ValueError, match="teacher_logits_B_T_V"):
        full_vocab_reverse_kl(torch.zeros(1, 2, 3), torch.zeros(1, 2, 4), torch.ones(1, 2))
    with pytest.raises(ValueError, match="mask_B_T"):
        full_vocab_reverse_kl(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), torch.ones(1, 3))
