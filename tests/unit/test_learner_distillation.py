"""Unit tests for the estimators (`learner/estimators.py`) on `pad_segments` batches: the table, the
typed inputs, and each estimator's loss.

No Ray, no DeepSpeed: padding, the estimators and the loss are plain tensor code.
"""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from learner_settings import SETTINGS, learner_settings

from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.job_spec import HyperParameters
from opd_trainer.learner import loss as opd_loss
from opd_trainer.learner.batch import LearnerBatch, logprobs_of_targets, pad_segments
from opd_trainer.learner.estimators import (
    ESTIMATORS,
    DistillationSettings,
    distillation_loss,
)
from opd_trainer.learner.settings import LearnerSettings
from opd_trainer.records import LLMCall

VOCAB, TOP_K = 11, 3
CPU = torch.device("cpu")


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


def _settings(estimator: str, **hyper_parameters: object) -> LearnerSettings:
    top_k = TOP_K if ESTIMATORS[estimator].needs_top_k else 0
    return learner_settings(distill_loss=estimator, teacher_top_k=top_k, **hyper_parameters)


def _batch(settings: LearnerSettings, with_top_k: bool = True) -> LearnerBatch:
    return pad_segments(_segments(with_top_k), settings.distillation.teacher_top_k, CPU)


def _loss_and_grad(
    estimator: str, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], LearnerBatch]:
    settings = _settings(estimator, temperature=temperature)
    batch = _batch(settings)
    first = batch.first_scored_position
    width = batch.mask_B_T.shape[1]
    generator = torch.Generator().manual_seed(1)
    logits_B_S_V = torch.randn(2, width - first, VOCAB, generator=generator).requires_grad_(True)
    learner_B_T = logprobs_of_targets(logits_B_S_V, batch, temperature)
    reward_adv_B = torch.tensor([-0.5, 0.5])
    inputs = batch.distillation_inputs(logits_B_S_V, learner_B_T, reward_adv_B, None)
    loss, stats = distillation_loss(settings.distillation, inputs)
    (grad_B_S_V,) = torch.autograd.grad(loss, logits_B_S_V)
    return loss, grad_B_S_V, stats, batch


def test_sampled_is_todays_advantage_through_the_policy_gradient_exactly() -> None:
    settings = SETTINGS
    batch = _batch(settings, with_top_k=False)
    first = batch.first_scored_position
    logits_B_S_V = torch.randn(2, batch.mask_B_T.shape[1] - first, VOCAB)
    learner_B_T = logprobs_of_targets(logits_B_S_V, batch, settings.temperature)
    reward_adv_B = torch.tensor([-0.5, 0.5])
    inputs = batch.distillation_inputs(logits_B_S_V, learner_B_T, reward_adv_B, None)
    got, _ = distillation_loss(settings.distillation, inputs)
    advantages_B_T = opd_loss.opd_advantages(
        batch.sampler_B_T, batch.teacher_B_T, batch.mask_B_T, 1.0, reward_adv_B, 1.0
    )
    want, _ = opd_loss.policy_loss(learner_B_T, batch.sampler_B_T, advantages_B_T, batch.mask_B_T, 2.0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_every_estimator_trains_only_completion_positions(estimator: str) -> None:
    _, grad_B_S_V, stats, batch = _loss_and_grad(estimator)
    first = batch.first_scored_position
    trained_B_S = batch.mask_B_T[:, first:] > 0
    assert (grad_B_S_V[~trained_B_S] == 0).all()
    assert (grad_B_S_V[trained_B_S].abs().sum(-1) > 0).all()
    assert float(stats["signal_std"]) > 0
    if ESTIMATORS[estimator].needs_top_k:
        assert 0 < float(stats["teacher_topk_mass"]) <= 1 and 0 < float(stats["student_topk_mass"]) <= 1
    else:
        assert "teacher_topk_mass" not in stats  # its batch carries no top-k


def test_sampled_logs_the_top_k_coverage_when_the_job_asks_for_the_top_k() -> None:
    settings = learner_settings(distill_loss="sampled", teacher_top_k=TOP_K)
    batch = _batch(settings)
    assert batch.top_ids_B_T_K is not None and batch.top_ids_B_T_K.shape[-1] == TOP_K
    first = batch.first_scored_position
    logits_B_S_V = torch.randn(2, batch.mask_B_T.shape[1] - first, VOCAB)
    learner_B_T = logprobs_of_targets(logits_B_S_V, batch, 1.0)
    _, stats = distillation_loss(
        settings.distillation, batch.distillation_inputs(logits_B_S_V, learner_B_T, None, None)
    )
    assert 0 < float(stats["teacher_topk_mass"]) <= 1


@pytest.mark.parametrize("estimator", [e.name for e in ESTIMATORS.values() if e.needs_top_k])
def test_estimators_that_read_the_top_k_are_refused_without_it(estimator: str) -> None:
    """Declared once (`Estimator.needs_top_k`), checked where settings are made: the job spec, and
    `DistillationSettings` for settings built by hand."""
    with pytest.raises(ConfigError, match=f"distill_loss {estimator} needs hyper_parameters.teacher_top_k"):
        learner_settings(distill_loss=estimator, teacher_top_k=0)
    with pytest.raises(ValueError, match=f"distill_loss {estimator} needs hyper_parameters.teacher_top_k"):
        dataclasses.replace(SETTINGS.distillation, distill_loss=estimator)
    with pytest.raises(ValueError, match="unknown distill_loss 'topk'; one of topk_forward"):
        dataclasses.replace(SETTINGS.distillation, distill_loss="topk")


@pytest.mark.parametrize("estimator", ["topk_reverse", "topk_forward", "jsd"])
def test_top_k_losses_compare_at_temperature_one_whatever_the_sampling_temperature(estimator: str) -> None:
    """Sampling at 0.7 changes only the importance ratio of the reward term, not the distillation term."""
    results = []
    for temperature in (1.0, 0.7):
        settings = _settings(estimator, reward_coef=0.0, temperature=temperature)
        batch = _batch(settings)
        first = batch.first_scored_position
        logits_B_S_V = torch.randn(
            2, batch.mask_B_T.shape[1] - first, VOCAB, generator=torch.Generator().manual_seed(1)
        ).requires_grad_(True)
        learner_B_T = logprobs_of_targets(logits_B_S_V, batch, temperature)
        inputs = batch.distillation_inputs(logits_B_S_V, learner_B_T, None, None)
        loss, _ = distillation_loss(settings.distillation, inputs)
        results.append((loss, torch.autograd.grad(loss, logits_B_S_V)[0]))
    (loss_1, grad_1), (loss_07, grad_07) = results
    assert torch.equal(loss_1, loss_07) and torch.equal(grad_1, grad_07)
    assert batch.top_ids_B_T_K is not None and batch.top_logprobs_B_T_K is not None
    reverse, _ = opd_loss.topk_reverse_kl_loss(
        logits_B_S_V.detach(),
        batch.top_ids_B_T_K[:, first:],
        batch.top_logprobs_B_T_K[:, first:],
        batch.mask_B_T[:, first:],
    )
    if estimator == "topk_reverse":
        torch.testing.assert_close(loss_1, reverse)


def test_the_spec_offers_exactly_the_declared_estimators_with_their_top_k_defaults() -> None:
    field = HyperParameters.model_fields["distill_loss"]
    assert HyperParameters.model_json_schema()["properties"]["distill_loss"]["enum"] == list(ESTIMATORS)
    for estimator in ESTIMATORS.values():
        hp = HyperParameters(distill_loss=estimator.name)
        assert hp.teacher_top_k == estimator.default_top_k == (8 if estimator.needs_top_k else 0)
        assert f"{estimator.name}: {estimator.summary}" in (field.description or "")


def test_learner_settings_survive_the_trip_to_a_ray_actor() -> None:
    settings = _settings("jsd", kl_coef=0.5, jsd_beta=0.25)
    assert pickle.loads(pickle.dumps(settings)) == settings
    assert settings.distillation == DistillationSettings(
        distill_loss="jsd", teacher_top_k=TOP_K, kl_coef=0.5, jsd_beta=0.25, ratio_cap=2.0
    )


def test_the_spec_reads_the_table_without_torch_and_the_pure_learner_without_ray() -> None:
    """The API server validates specs without torch installed; unit tests never start Ray."""
    code = (
        "import sys\n"
        "import opd_trainer.jobspec.job_spec\n"
        "assert 'torch' not in sys.modules, 'the job spec imported torch'\n"
        "assert 'opd_trainer.learner' not in sys.modules, 'the job spec imported the learner'\n"
        "import opd_trainer.learner.batch, opd_trainer.learner.estimators, opd_trainer.learner.settings\n"
        "assert 'ray' not in sys.modules, 'a pure learner module imported ray'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
