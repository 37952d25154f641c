"""Unit tests for the learner's estimator dispatch (`learner.distillation_loss`) on `Learner._pad` batches.

No DeepSpeed: `Learner` builds its engine lazily, and padding plus the loss are plain tensor code.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from learner_settings import SETTINGS

from opd_trainer.learner import loss as opd_loss
from opd_trainer.learner.deepspeed_learner import Learner, distillation_loss
from opd_trainer.records import LLMCall

VOCAB, TOP_K = 11, 3
ESTIMATORS = ["sampled", "sampled_baseline", "topk_reverse", "topk_forward", "jsd"]


def _segments(with_top_k: bool) -> list[LLMCall]:
    generator = np.random.default_rng(0)
    segments = []
    for index, (prompt_len, completion_len) in enumerate([(4, 3), (6, 2)]):
        logprobs = np.sort(np.log(generator.dirichlet(np.ones(VOCAB))))[::-1][:TOP_K].astype(np.float32)
        ids = np.stack([generator.permutation(VOCAB)[:TOP_K] for _ in range(completion_len)]).astype(np.int32)
        segments.append(
            LLMCall(
                prompt_token_ids=generator.integers(0, VOCAB, prompt_len).tolist(),
                completion_token_ids=generator.integers(0, VOCAB, completion_len).tolist(),
                sampler_logprobs=(-generator.random(completion_len) - 0.5).tolist(),
                teacher_logprobs=(-generator.random(completion_len) - 0.5).tolist(),
                group_id=0,
                rollout_id=index,
                reward=float(index),
                teacher_top_ids=ids if with_top_k else None,
                teacher_top_logprobs=np.tile(logprobs, (completion_len, 1)) if with_top_k else None,
            )
        )
    return segments


def _loss_and_grad(
    estimator: str, temperature: float = 1.0, with_top_k: bool = True
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    settings = dataclasses.replace(SETTINGS, distill_loss=estimator, temperature=temperature)
    learner = Learner(settings)
    batch = learner._pad(_segments(with_top_k))
    first = int(batch["first_scored_position"])
    width = batch["mask_B_T"].shape[1]
    generator = torch.Generator().manual_seed(1)
    logits_B_S_V = torch.randn(2, width - first, VOCAB, generator=generator).requires_grad_(True)
    learner_B_T = learner._logprobs_of_targets(logits_B_S_V, batch)
    reward_adv_B = torch.tensor([-0.5, 0.5])
    loss, stats = distillation_loss(settings, batch, logits_B_S_V, learner_B_T, reward_adv_B)
    (grad_B_S_V,) = torch.autograd.grad(loss, logits_B_S_V)
    return loss, grad_B_S_V, stats, batch


def test_sampled_is_todays_advantage_through_the_policy_gradient_exactly() -> None:
    settings = SETTINGS
    learner = Learner(settings)
    batch = learner._pad(_segments(with_top_k=False))
    first = int(batch["first_scored_position"])
    logits_B_S_V = torch.randn(2, batch["mask_B_T"].shape[1] - first, VOCAB)
    learner_B_T = learner._logprobs_of_targets(logits_B_S_V, batch)
    reward_adv_B = torch.tensor([-0.5, 0.5])
    got, _ = distillation_loss(settings, batch, logits_B_S_V, learner_B_T, reward_adv_B)
    advantages_B_T = opd_loss.opd_advantages(
        batch["sampler_B_T"], batch["teacher_B_T"], batch["mask_B_T"], 1.0, reward_adv_B, 1.0
    )
    want, _ = opd_loss.policy_loss(learner_B_T, batch["sampler_B_T"], advantages_B_T, batch["mask_B_T"], 2.0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_estimator_trains_only_completion_positions(estimator: str) -> None:
    _, grad_B_S_V, stats, batch = _loss_and_grad(estimator)
    first = int(batch["first_scored_position"])
    trained_B_S = batch["mask_B_T"][:, first:] > 0
    assert (grad_B_S_V[~trained_B_S] == 0).all()
    assert (grad_B_S_V[trained_B_S].abs().sum(-1) > 0).all()
    assert float(stats["signal_std"]) > 0
    assert 0 < float(stats["teacher_topk_mass"]) <= 1 and 0 < float(stats["student_topk_mass"]) <= 1


@pytest.mark.parametrize("estimator", ["topk_reverse", "topk_forward", "jsd"])
def test_top_k_losses_compare_at_temperature_one_whatever_the_sampling_temperature(estimator: str) -> None:
    """Sampling at 0.7 changes only the importance ratio of the reward term, not the distillation term."""
    settings = dataclasses.replace(SETTINGS, distill_loss=estimator, reward_coef=0.0)
    results = []
    for temperature in (1.0, 0.7):
        learner = Learner(dataclasses.replace(settings, temperature=temperature))
        batch = learner._pad(_segments(with_top_k=True))
        first = int(batch["first_scored_position"])
        logits_B_S_V = torch.randn(
            2, batch["mask_B_T"].shape[1] - first, VOCAB, generator=torch.Generator().manual_seed(1)
        ).requires_grad_(True)
        learner_B_T = learner._logprobs_of_targets(logits_B_S_V, batch)
        loss, _ = distillation_loss(learner.settings, batch, logits_B_S_V, learner_B_T, None)
        results.append((loss, torch.autograd.grad(loss, logits_B_S_V)[0]))
    (loss_1, grad_1), (loss_07, grad_07) = results
    assert torch.equal(loss_1, loss_07) and torch.equal(grad_1, grad_07)
    reverse, _ = opd_loss.topk_reverse_kl_loss(
        logits_B_S_V.detach(),
        batch["teacher_top_ids_B_T_K"][:, first:],
        batch["teacher_top_logprobs_B_T_K"][:, first:],
        batch["mask_B_T"][:, first:],
    )
    if estimator == "topk_reverse":
        torch.testing.assert_close(loss_1, reverse)


def test_top_k_estimator_without_the_teachers_top_k_is_refused() -> None:
    with pytest.raises(ValueError, match="needs the teacher's top-k"):
        _loss_and_grad("topk_reverse", with_top_k=False)
