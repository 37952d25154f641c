"""The learner's typed batch (`learner/batch.py`): padding, the teacher's top-k it must carry, and the
number of model calls a forward makes (what ZeRO-3 ranks compare before a forward)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_shared_prefix import _batches, _model

from opd_trainer.learner.batch import pad_segments, prefix_plan, scored_logits
from opd_trainer.learner.shared_prefix import model_calls
from opd_trainer.records import LLMCall

CPU = torch.device("cpu")


def _segment(prompt: list[int], completion: list[int], top_k: int | None) -> LLMCall:
    ids = np.arange(len(completion) * (top_k or 0), dtype=np.int32).reshape(len(completion), top_k or 0)
    return LLMCall(
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        sampler_logprobs=[-1.0] * len(completion),
        teacher_logprobs=[-2.0] * len(completion),
        group_id=0,
        rollout_id=len(prompt),
        reward=0.5,
        teacher_top_ids=ids if top_k is not None else None,
        teacher_top_logprobs=np.full(ids.shape, -3.0, dtype=np.float32) if top_k is not None else None,
    )


def test_padding_aligns_every_per_token_value_with_the_token_it_predicts() -> None:
    batch = pad_segments([_segment([5, 6, 7], [8, 9], 2), _segment([5, 6], [4, 3, 2], 2)], 2, CPU)
    # Prompts end at one column (the shorter padded before it), so completions start together.
    assert batch.first_scored_position == 2
    assert batch.input_ids_B_T.tolist() == [[5, 6, 7, 8, 9, 0], [0, 5, 6, 4, 3, 2]]
    assert batch.attention_B_T.tolist() == [[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]]
    assert batch.targets_B_T.tolist() == [[6, 7, 8, 9, 0], [5, 6, 4, 3, 2]]
    assert batch.mask_B_T.tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert batch.teacher_B_T.tolist() == [[0, 0, -2, -2, 0], [0, 0, -2, -2, -2]]
    assert batch.lengths == (5, 5) and batch.prompt_lengths == (3, 2)
    assert batch.top_ids_B_T_K is not None and batch.top_logprobs_B_T_K is not None
    assert batch.top_ids_B_T_K.shape == (2, 5, 2)
    assert batch.top_ids_B_T_K[0, 2:4].tolist() == [[0, 1], [2, 3]]
    assert batch.top_logprobs_B_T_K[1, 1].tolist() == [0, 0]  # a prompt position: never read
    # The scored slice the estimators get starts where the logits start, as wide as the longest
    # completion whatever the prompts' lengths.
    inputs = batch.distillation_inputs(torch.zeros(2, 3, 11), torch.zeros(2, 5), None, None)
    assert inputs.top_ids_B_S_K is not None and inputs.top_ids_B_S_K.shape == (2, 3, 2)
    assert [t.shape for t in inputs.top_k()] == [(2, 3, 2), (2, 3, 2), (2, 3)]


def test_the_scored_width_is_the_longest_completion_however_the_prompts_differ() -> None:
    segments = [_segment(list(range(1, 41)), [8, 9], None), _segment([5, 6], [4, 3, 2], None)]
    batch = pad_segments(segments, 0, CPU)
    assert batch.input_ids_B_T.shape == (2, 43)
    assert batch.targets_B_T.shape[1] - batch.first_scored_position == 3
    trained = [
        [t for t, m in zip(targets, mask, strict=True) if m]
        for targets, mask in zip(batch.targets_B_T.tolist(), batch.mask_B_T.tolist(), strict=True)
    ]
    assert trained == [[8, 9], [4, 3, 2]]


def test_a_job_without_the_top_k_pads_none_and_its_inputs_say_so() -> None:
    batch = pad_segments([_segment([5, 6], [8], 4)], 0, CPU)
    assert batch.top_ids_B_T_K is None and batch.top_logprobs_B_T_K is None
    inputs = batch.distillation_inputs(torch.zeros(1, 1, 11), torch.zeros(1, 2), None, None)
    assert not inputs.has_top_k
    with pytest.raises(ValueError, match="no teacher top-k"):
        inputs.top_k()


@pytest.mark.parametrize(
    ("top_k", "carried", "shapes"),
    [(3, None, "['None']"), (3, 2, "['(2, 2)']")],
)
def test_a_segment_whose_top_k_is_missing_or_another_k_is_refused(
    top_k: int, carried: int | None, shapes: str
) -> None:
    segments = [_segment([5, 6], [8, 9], top_k), _segment([5, 7], [8, 9], carried)]
    with pytest.raises(ValueError) as raised:
        pad_segments(segments, top_k, CPU)
    assert str(raised.value) == (
        f"segment 1 carries the teacher's top-k with shapes {shapes}, expected (2, {top_k}) "
        "(completion tokens, hyper_parameters.teacher_top_k)"
    )


@pytest.mark.parametrize("case", [*_batches(), "one_token_prompt"])
def test_model_calls_counts_the_calls_the_forward_makes(case: str) -> None:
    """ZeRO-3 ranks compare `model_calls` and must then call the model exactly that often."""
    model = _model()
    calls: list[int] = []

    def counting(**kwargs: object) -> object:
        calls.append(1)
        return model(**kwargs)

    if case == "one_token_prompt":
        segments = [_segment([4], [1, 2], None), _segment([4, 5], [2], None)]
    else:
        segments = _batches()[case]
    batch = pad_segments(segments, 0, CPU)
    plan = prefix_plan(batch)
    assert (plan is None) == (case == "one_token_prompt")
    with torch.no_grad():
        scored_logits(counting, batch, plan, CPU)
    assert len(calls) == model_calls(plan)


def test_sampled_judges_a_stale_row_by_the_student_being_trained_unless_asked_not_to() -> None:
    """`stale_divergence`: on a row sampled with older weights the log-ratio signal (and so the
    advantage) uses the learner's logprob now; a fresh row, or `sampler`, keeps the sampler's."""
    from opd_trainer.learner.estimators import DistillationSettings, sampled

    fresh, stale = _segment([5, 6], [8, 9], None), _segment([5, 6], [8, 9], None)
    stale = dataclasses.replace(stale, staleness=2)
    batch = pad_segments([fresh, stale], 0, CPU)
    assert batch.stale_B is not None and batch.stale_B.tolist() == [False, True]
    learner_B_T = torch.full((2, 3), -1.5, requires_grad=True)  # the sampler said -1.0, the teacher -2.0
    inputs = batch.distillation_inputs(torch.zeros(2, 2, 11), learner_B_T, None, None)
    signals = {}
    for mode in ("current", "sampler"):
        settings = DistillationSettings("sampled", 0, 1.0, 0.5, 2.0, stale_divergence=mode)
        signals[mode] = sampled(inputs, settings).signal_B_T
    trained = batch.mask_B_T > 0
    assert signals["current"][0][trained[0]].tolist() == [1.0, 1.0]  # fresh: -1.0 - (-2.0)
    assert signals["current"][1][trained[1]].tolist() == [0.5, 0.5]  # stale: -1.5 - (-2.0)
    assert signals["sampler"][1][trained[1]].tolist() == [1.0, 1.0]
