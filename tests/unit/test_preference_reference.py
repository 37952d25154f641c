"""The preference term's reference, reduction, control and gradient norms (`Learner._update`), and the
kept beacon rewrites' SFT term, on a tiny random Qwen2 student: one DeepSpeed rank (CPU, gloo), no Ray."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
from learner_settings import learner_settings
from tiny_student import VOCAB, save_tiny_student

from opd_trainer.learner.preference_loss import beacon_sft_loss, preference_loss
from opd_trainer.records import LLMCall

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is first imported

TARGETS = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def student(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_student(tmp_path_factory.mktemp("student"))


def _segments() -> list[LLMCall]:
    """Two prompts of two rollouts each; prompt 0's rollouts are a pair (0 chosen, 1 rejected), and
    rollout 2 is a kept beacon rewrite (not distilled)."""
    generator = torch.Generator().manual_seed(1)

    def tokens(length: int) -> list[int]:
        return torch.randint(1, VOCAB, (length,), generator=generator).tolist()

    system = tokens(9)
    prompts = [system + tokens(4), system + tokens(6)]
    marks = {0: ((0, 1),), 1: ((0, -1),)}
    return [
        LLMCall(
            prompt_token_ids=prompts[group],
            completion_token_ids=(completion := tokens(length)),
            sampler_logprobs=[-2.0] * len(completion),
            teacher_logprobs=[-1.0] * len(completion),
            group_id=group,
            rollout_id=index,
            reward=1.0 - index % 2,
            preference_pairs=marks.get(index, ()),
            distilled=index != 2,
            beacon="a beacon" if index == 2 else "",
        )
        for index, (group, length) in enumerate([(0, 3), (0, 7), (1, 5), (1, 2)])
    ]


def _learner(student: str, beacon_sft_coef: float = 0.0, **hyper_parameters: Any) -> Any:
    """A learner of `student`; `beacon_sft_coef` set on its settings alone (the job spec would also
    want a beacon-writing rollout component)."""
    from opd_trainer.learner.deepspeed_learner import Learner

    settings = learner_settings(
        model=student,
        learning_rate=5e-2,
        turn_preference_coef=1.0,
        turn_preference_beta=1.0,
        **hyper_parameters,
    )
    learner = Learner(dataclasses.replace(settings, beacon_sft_coef=beacon_sft_coef))
    learner.initialize()
    return learner


def test_the_initial_reference_gives_a_margin_of_exactly_zero_at_step_one_then_learns(student: str) -> None:
    learner = _learner(student)
    first = learner.train_step([_segments()])
    assert first["preference/margin"] == 0.0
    assert first["preference/loss"] == pytest.approx(
        torch.log(torch.tensor(2.0)).item() / 2
    )  # 1 pair, 2 prompts
    second = learner.train_step([_segments()])
    assert second["preference/margin"] > 0 and second["preference/accuracy"] == 1.0


def test_under_lora_the_initial_reference_is_the_base_with_the_adapter_off(student: str) -> None:
    learner = _learner(student, lora={"r": 4, "lora_alpha": 8, "target_modules": TARGETS})
    assert learner._reference is None  # no copy: the adapter is switched off
    assert learner.train_step([_segments()])["preference/margin"] == 0.0
    assert learner.train_step([_segments()])["preference/margin"] > 0


def test_the_teacher_reference_reads_the_teachers_logprobs(student: str) -> None:
    learner = _learner(student, turn_preference_reference="teacher")
    assert learner._reference is None  # nothing frozen to hold
    # The student's summed logprobs minus the teacher's −1 a token: the 3- and 7-token sides differ.
    assert learner.train_step([_segments()])["preference/margin"] != 0.0


@pytest.mark.parametrize("lora", [False, True])
def test_a_rolling_reference_restarts_the_margin_at_each_refresh(student: str, lora: bool) -> None:
    adapter = {"lora": {"r": 4, "lora_alpha": 8, "target_modules": TARGETS}} if lora else {}
    every_step = _learner(student, turn_preference_reference="rolling", **adapter)
    margins = [every_step.train_step([_segments()])["preference/margin"] for _ in range(3)]
    assert margins == [0.0, 0.0, 0.0]
    every_other = _learner(
        student, turn_preference_reference="rolling", turn_preference_reference_steps=2, **adapter
    )
    margins = [every_other.train_step([_segments()])["preference/margin"] for _ in range(3)]
    assert margins[0] == 0.0 and margins[1] > 0 and margins[2] == 0.0


def _real_margin(learner: Any, start: list[list[float]]) -> float:
    """How far the chosen side's summed logprob rose over the rejected side's since `start`."""
    now = learner.compute_logprobs(_segments()[:2])
    return (sum(now[0]) - sum(start[0])) - (sum(now[1]) - sum(start[1]))


def test_the_swapped_control_prefers_the_rejected_side(student: str) -> None:
    swapped, plain = _learner(student, turn_preference_swap=True), _learner(student)
    start = plain.compute_logprobs(_segments()[:2])
    swapped.train_step([_segments()])
    plain.train_step([_segments()])
    # The logged margin is the term's own (swapped) one: it grows, so the real chosen side falls back.
    assert swapped.train_step([_segments()])["preference/margin"] > 0
    plain.train_step([_segments()])
    assert _real_margin(swapped, start) < 0 < _real_margin(plain, start)


def test_each_term_reports_its_own_gradient_norm(student: str) -> None:
    learner = _learner(student)
    metrics = learner.train_step([_segments()])
    assert metrics["grad_norm/preference"] > 0 and metrics["grad_norm/distillation"] > 0
    # With a margin of 0 both sides' gradients are β/2 times their log-likelihood gradients, scaled by
    # 1 / 2 prompts: the distillation norm is the update's norm without the preference term.
    assert metrics["grad_norm"] <= metrics["grad_norm/distillation"] + metrics["grad_norm/preference"] + 1e-6


def test_beacon_sft_trains_the_kept_rewrites_likelihood(student: str) -> None:
    learner = _learner(student, beacon_sft_coef=1.0)
    rewrite = _segments()[2:3]
    before = sum(learner.compute_logprobs(rewrite)[0])
    metrics = learner.train_step([_segments()])
    assert metrics["beacons/sft_tokens"] == 5.0 and metrics["beacons/sft_nll"] > 0
    assert sum(learner.compute_logprobs(rewrite)[0]) > before


def test_the_prompts_reduction_weighs_pairs_by_the_batchs_prompts() -> None:
    learner_B_T = torch.tensor([[0.0, -1.0], [0.0, -2.0], [0.0, -1.0]])
    reference_B_T = torch.zeros(3, 2)
    mask_B_T = torch.tensor([[0.0, 1.0]] * 3)
    sides_B_P = torch.tensor([[1.0], [-1.0], [0.0]])
    mean, stats = preference_loss(learner_B_T, reference_B_T, mask_B_T, sides_B_P, beta=1.0)
    per_prompt, _ = preference_loss(learner_B_T, reference_B_T, mask_B_T, sides_B_P, beta=1.0, per=4)
    assert stats["preference/margin"] == 1.0
    expected = -torch.nn.functional.logsigmoid(torch.tensor(1.0))
    torch.testing.assert_close(mean, expected)
    torch.testing.assert_close(per_prompt, expected / 4)


def test_beacon_sft_loss_is_the_rewrites_mean_token_nll_and_zero_without_one() -> None:
    learner_B_T = torch.tensor([[-1.0, -3.0], [-5.0, -5.0]], requires_grad=True)
    mask_B_T = torch.ones(2, 2)
    loss, stats = beacon_sft_loss(learner_B_T, mask_B_T, torch.tensor([True, False]))
    assert float(loss) == 2.0 and stats == {"beacons/sft_nll": 2.0, "beacons/sft_tokens": 2.0}
    none, stats = beacon_sft_loss(learner_B_T, mask_B_T, torch.tensor([False, False]))
    assert float(none) == 0.0 and none.requires_grad and stats == {}
