"""Unit tests for the top-k distillation estimators and the baselined sampled estimator (learner.loss)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from opd_trainer.learner.loss import (
    add_reward_advantages,
    full_vocab_reverse_kl,
    gather_token_logprobs,
    policy_loss,
    reverse_kl_advantages,
    sampled_baseline_advantages,
    signal_std,
    student_bucket_logprobs,
    teacher_bucket_logprobs,
    topk_forward_kl_loss,
    topk_jsd_loss,
    topk_metrics,
    topk_reverse_kl_loss,
    topk_signal_baseline,
)

NAN = float("nan")

# One position, vocabulary 3: student p = [0.5, 0.25, 0.25]; the teacher's top-1 is token 0 with p = 0.8.
# Buckets (token 0, tail): student [0.5, 0.5], teacher [0.8, 0.2].
STUDENT_LOGITS_1_1_3 = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
TOP_IDS_1_1_1 = torch.tensor([[[0]]], dtype=torch.int32)
TOP_LOGPROBS_1_1_1 = torch.log(torch.tensor([[[0.8]]]))
ONE_1_1 = torch.ones(1, 1)


def _kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))


def test_buckets_hold_the_top_k_and_the_rest_on_each_side() -> None:
    student = student_bucket_logprobs(STUDENT_LOGITS_1_1_3, TOP_IDS_1_1_1)
    teacher = teacher_bucket_logprobs(TOP_LOGPROBS_1_1_1)
    assert_close(student.exp(), torch.tensor([[[0.5, 0.5]]]))
    assert_close(teacher.exp(), torch.tensor([[[0.8, 0.2]]]))


def test_each_estimator_matches_hand_computed_values() -> None:
    args = (STUDENT_LOGITS_1_1_3, TOP_IDS_1_1_1, TOP_LOGPROBS_1_1_1, ONE_1_1)
    reverse, _ = topk_reverse_kl_loss(*args)
    forward, _ = topk_forward_kl_loss(*args)
    jsd, _ = topk_jsd_loss(*args, beta=0.5)
    student, teacher, mixture = [0.5, 0.5], [0.8, 0.2], [0.65, 0.35]
    assert reverse.item() == pytest.approx(_kl(student, teacher), rel=1e-5)
    assert forward.item() == pytest.approx(_kl(teacher, student), rel=1e-5)
    assert jsd.item() == pytest.approx(0.5 * _kl(teacher, mixture) + 0.5 * _kl(student, mixture), rel=1e-5)
    jsd_low, _ = topk_jsd_loss(*args, beta=0.1)
    mixture = [0.1 * t + 0.9 * s for s, t in zip(student, teacher, strict=True)]
    assert jsd_low.item() == pytest.approx(
        0.1 * _kl(teacher, mixture) + 0.9 * _kl(student, mixture), rel=1e-5
    )


def _random_pair(seed: int, vocab: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    student_B_T_V = torch.randn(2, 4, vocab, generator=generator, dtype=torch.float64) * 2
    teacher_B_T_V = torch.randn(2, 4, vocab, generator=generator, dtype=torch.float64) * 2
    mask_B_T = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float64)
    return student_B_T_V, teacher_B_T_V, mask_B_T


def _teacher_top_k(teacher_B_T_V: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs_B_T_V = torch.log_softmax(teacher_B_T_V, dim=-1)
    top_logprobs_B_T_K, top_ids_B_T_K = logprobs_B_T_V.topk(k, dim=-1)
    return top_ids_B_T_K.int(), top_logprobs_B_T_K


def test_with_k_equal_to_the_vocabulary_the_bucketed_kl_is_the_exact_one() -> None:
    student_B_T_V, teacher_B_T_V, mask_B_T = _random_pair(0)
    ids, logprobs = _teacher_top_k(teacher_B_T_V, k=student_B_T_V.shape[-1])
    reverse, _ = topk_reverse_kl_loss(student_B_T_V, ids, logprobs, mask_B_T)
    assert_close(reverse, full_vocab_reverse_kl(student_B_T_V, teacher_B_T_V, mask_B_T).double())
    forward, _ = topk_forward_kl_loss(student_B_T_V, ids, logprobs, mask_B_T)
    assert_close(forward, full_vocab_reverse_kl(teacher_B_T_V, student_B_T_V, mask_B_T).double())


def test_with_k_below_the_vocabulary_the_tail_is_one_bucket_by_brute_force() -> None:
    student_B_T_V, teacher_B_T_V, mask_B_T = _random_pair(1)
    k = 3
    ids, logprobs = _teacher_top_k(teacher_B_T_V, k)
    got, per_token_B_T = topk_reverse_kl_loss(student_B_T_V, ids, logprobs, mask_B_T)
    student_p = torch.softmax(student_B_T_V, -1)
    teacher_p = torch.softmax(teacher_B_T_V, -1)
    total, count = 0.0, 0
    for b in range(2):
        for t in range(4):
            if not mask_B_T[b, t]:
                assert per_token_B_T[b, t] == 0
                continue
            top = ids[b, t].tolist()
            p = [student_p[b, t, v].item() for v in top]
            q = [teacher_p[b, t, v].item() for v in top]
            p.append(1 - sum(p))
            q.append(1 - sum(q))
            total, count = total + _kl(p, q), count + 1
    assert got.item() == pytest.approx(total / count, rel=1e-9)


@pytest.mark.parametrize("estimator", ["reverse", "forward", "jsd"])
def test_gradcheck_on_small_double_shapes(estimator: str) -> None:
    student_B_T_V, teacher_B_T_V, mask_B_T = _random_pair(2, vocab=5)
    ids, logprobs = _teacher_top_k(teacher_B_T_V, k=2)
    student_B_T_V.requires_grad_(True)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        if estimator == "reverse":
            return topk_reverse_kl_loss(logits, ids, logprobs, mask_B_T)[0]
        if estimator == "forward":
            return topk_forward_kl_loss(logits, ids, logprobs, mask_B_T)[0]
        return topk_jsd_loss(logits, ids, logprobs, mask_B_T, beta=0.3)[0]

    assert torch.autograd.gradcheck(loss, (student_B_T_V,))


@pytest.mark.parametrize("estimator", [topk_reverse_kl_loss, topk_forward_kl_loss])
def test_masked_positions_are_inert_even_with_garbage(estimator) -> None:
    student_B_T_V, teacher_B_T_V, mask_B_T = _random_pair(3)
    ids, logprobs = _teacher_top_k(teacher_B_T_V, k=3)
    # Garbage where nothing is trained: an out-of-range id and nan logprobs (e.g. unscored padding).
    ids[0, 0, 0], ids[0, 3] = 10**6, -5
    logprobs[0, 0], logprobs[0, 3, 1] = NAN, NAN
    logits = student_B_T_V.clone().requires_grad_(True)
    loss, per_token_B_T = estimator(logits, ids, logprobs, mask_B_T)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert (grad[0, 0] == 0).all() and (grad[0, 3] == 0).all()
    assert per_token_B_T[0, 0] == 0 and per_token_B_T[0, 3] == 0
    assert (grad[1] != 0).any()
    # The trained positions' loss does not depend on what the masked ones hold.
    clean_ids, clean_logprobs = _teacher_top_k(teacher_B_T_V, k=3)
    assert_close(loss, estimator(student_B_T_V, clean_ids, clean_logprobs, mask_B_T)[0])


def test_student_that_equals_the_teacher_on_the_buckets_has_zero_loss_and_gradient() -> None:
    _, teacher_B_T_V, mask_B_T = _random_pair(4)
    ids, logprobs = _teacher_top_k(teacher_B_T_V, k=2)
    logits = teacher_B_T_V.clone().requires_grad_(True)
    loss, _ = topk_reverse_kl_loss(logits, ids, logprobs, mask_B_T)
    (grad,) = torch.autograd.grad(loss, logits)
    assert loss.item() == pytest.approx(0.0, abs=1e-12)
    assert_close(grad, torch.zeros_like(grad))


def test_metrics_and_signal_spread_by_hand() -> None:
    metrics = topk_metrics(STUDENT_LOGITS_1_1_3, TOP_IDS_1_1_1, TOP_LOGPROBS_1_1_1, ONE_1_1)
    assert metrics["teacher_topk_mass"].item() == pytest.approx(0.8)
    assert metrics["student_topk_mass"].item() == pytest.approx(0.5)
    signal_B_T = torch.tensor([[1.0, 3.0, NAN, 100.0]])
    mask_B_T = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    assert signal_std(signal_B_T, mask_B_T).item() == pytest.approx(1.0)


def test_sampled_baseline_advantage_and_reward_by_hand() -> None:
    sampler_B_T = torch.tensor([[-1.0, -2.0, NAN]])
    teacher_B_T = torch.tensor([[-1.5, -1.0, NAN]])
    baseline_B_T = torch.tensor([[0.25, 0.5, NAN]])
    mask_B_T = torch.tensor([[1.0, 1.0, 0.0]])
    got = sampled_baseline_advantages(sampler_B_T, teacher_B_T, baseline_B_T, mask_B_T, kl_coef=2.0)
    # −2·(s − t − b): −2·(0.5 − 0.25) = −0.5, −2·(−1 − 0.5) = 3.
    assert_close(got, torch.tensor([[-0.5, 3.0, 0.0]]))
    with_reward = add_reward_advantages(got, mask_B_T, torch.tensor([1.5]), reward_coef=2.0)
    assert_close(with_reward, torch.tensor([[2.5, 6.0, 0.0]]))
    assert_close(add_reward_advantages(got, mask_B_T, None, reward_coef=2.0), got)


def _per_draw_gradients(
    theta_V: torch.Tensor, draws_N: torch.Tensor, advantages_N: torch.Tensor
) -> torch.Tensor:
    """The policy gradient of each draw w.r.t. the logits, [N, V] (on-policy: ratio 1)."""
    logits_N_1_V = theta_V.expand(len(draws_N), 1, -1).clone().requires_grad_(True)
    learner_N_1 = gather_token_logprobs(logits_N_1_V, draws_N[:, None])
    mask_N_1 = torch.ones_like(learner_N_1)
    loss, _ = policy_loss(learner_N_1, learner_N_1.detach(), advantages_N[:, None], mask_N_1, 2.0, 1.0)
    (grad_N_1_V,) = torch.autograd.grad(loss, logits_N_1_V)
    return grad_N_1_V[:, 0]


def _student_and_teacher(seed: int, vocab: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    theta_V = torch.randn(vocab, generator=generator, dtype=torch.float64) * 2
    return theta_V, theta_V + torch.randn(vocab, generator=generator, dtype=torch.float64)


def test_signal_baseline_with_k_equal_to_the_vocabulary_is_the_variance_optimal_constant() -> None:
    theta_V, teacher_V = _student_and_teacher(4, vocab=9)
    p_V = torch.softmax(theta_V, 0)
    signal_V = torch.log_softmax(theta_V, 0) - torch.log_softmax(teacher_V, 0)
    # |e_y − p|² for every y, by brute force.
    weight_V = ((torch.eye(9, dtype=torch.float64) - p_V) ** 2).sum(-1)
    want = (p_V * signal_V * weight_V).sum() / (p_V * weight_V).sum()
    ids, logprobs = _teacher_top_k(teacher_V[None, None], k=9)
    got = topk_signal_baseline(theta_V[None, None], ids, logprobs, torch.ones(1, 1, dtype=torch.float64))
    assert got.item() == pytest.approx(want.item(), rel=1e-9)


def _gradients_per_token(
    theta_V: torch.Tensor, teacher_V: torch.Tensor, k: int, tokens_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Policy gradients w.r.t. the logits when `tokens_N` are sampled: sampled, sampled_baseline; [N, V]."""
    student_lp_V, teacher_lp_V = torch.log_softmax(theta_V, 0), torch.log_softmax(teacher_V, 0)
    sampler_N_1, teacher_N_1 = student_lp_V[tokens_N][:, None], teacher_lp_V[tokens_N][:, None]
    ids, logprobs = _teacher_top_k(teacher_V[None, None], k=k)
    baseline_1_1 = topk_signal_baseline(theta_V[None, None], ids, logprobs, torch.ones(1, 1))
    plain_N = reverse_kl_advantages(sampler_N_1, teacher_N_1, kl_coef=1.0)[:, 0]
    baselined_N = sampled_baseline_advantages(
        sampler_N_1, teacher_N_1, baseline_1_1.expand_as(sampler_N_1), torch.ones_like(sampler_N_1), 1.0
    )[:, 0]
    return _per_draw_gradients(theta_V, tokens_N, plain_N), _per_draw_gradients(
        theta_V, tokens_N, baselined_N
    )


def _exact_reverse_kl_gradient(theta_V: torch.Tensor, teacher_V: torch.Tensor) -> torch.Tensor:
    logits_V = theta_V.clone().requires_grad_(True)
    p_V, lp_V = torch.softmax(logits_V, 0), torch.log_softmax(logits_V, 0)
    (grad_V,) = torch.autograd.grad((p_V * (lp_V - torch.log_softmax(teacher_V, 0))).sum(), logits_V)
    return grad_V


@pytest.mark.parametrize(("seed", "k"), [(4, 50), (4, 8), (1, 8), (0, 8), (0, 1)])
def test_sampled_baseline_is_unbiased_and_lowers_variance_exactly(seed: int, k: int) -> None:
    """Expectations over every token, weighted by the student: both give ∇KL, the baseline less spread."""
    theta_V, teacher_V = _student_and_teacher(seed)
    p_V = torch.softmax(theta_V, 0)
    plain_V_V, baselined_V_V = _gradients_per_token(theta_V, teacher_V, k, torch.arange(len(theta_V)))
    exact_V = _exact_reverse_kl_gradient(theta_V, teacher_V)
    variances = []
    for grads_V_V in (plain_V_V, baselined_V_V):
        mean_V = (p_V[:, None] * grads_V_V).sum(0)
        # float32 inside gather_token_logprobs bounds the agreement.
        assert_close(mean_V, exact_V, rtol=1e-5, atol=1e-6)
        variances.append((p_V * ((grads_V_V - mean_V) ** 2).sum(-1)).sum().item())
    plain, baselined = variances
    # Var(b) = Var(b*) + (b − b*)²·E|g|²: at k = V the baseline is b* and can only help; at small k the
    # tail's one shared signal value can miss b* by more than |b*| (k = 1 here: 0.3334 vs 0.3326).
    if k >= 8:
        assert baselined < plain


def test_sampled_baseline_over_many_draws_matches_sampled_in_mean() -> None:
    theta_V, teacher_V = _student_and_teacher(4)
    draws_N = torch.multinomial(
        torch.softmax(theta_V, 0), 20_000, replacement=True, generator=torch.Generator().manual_seed(0)
    )
    exact_V = _exact_reverse_kl_gradient(theta_V, teacher_V)
    plain_N_V, baselined_N_V = _gradients_per_token(theta_V, teacher_V, 8, draws_N)
    for grads_N_V in (plain_N_V, baselined_N_V):
        # E‖mean − exact‖² = Σ_v Var_v / N; nine times that is far out in the tail.
        squared_error = ((grads_N_V.mean(0) - exact_V) ** 2).sum()
        assert squared_error < 9 * grads_N_V.var(0).sum() / len(draws_N)
    assert baselined_N_V.var(0).sum() < plain_N_V.var(0).sum()
