"""The learner's padding-free plain forward (`learner/packing.py`) equals the padded one.

A tiny random Qwen2 model in fp32 (transformers, no DeepSpeed): the estimator's loss
(`distillation_loss` on the inputs `Learner._update` builds) and every parameter's gradient match the
padded forward's, for rows of different prompt and completion lengths with and without a shared
preamble; rows of equal length take the padded forward.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from learner_settings import learner_settings
from test_shared_prefix import VOCAB, _call, _model

from opd_trainer.learner import batch as learner_batch
from opd_trainer.learner.batch import LearnerBatch, logprobs_of_targets, pad_segments, scored_logits
from opd_trainer.learner.estimators import distillation_loss
from opd_trainer.learner.packing import packing_saves
from opd_trainer.records import LLMCall

CPU = torch.device("cpu")
TOP_K = 4


def _tokens(generator: torch.Generator, length: int) -> list[int]:
    return torch.randint(1, VOCAB, (length,), generator=generator).tolist()


def _ragged(preamble: bool, top_k: int = 0) -> list[LLMCall]:
    """Rows whose prompts and completions all differ in length (one completion of one token), with the
    teacher's top-k when `top_k` > 0."""
    generator = torch.Generator().manual_seed(5)
    system = _tokens(generator, 19) if preamble else []
    shapes = ((3, 9), (11, 1), (6, 23), (2, 4), (8, 14))
    rows = [
        _call(system + _tokens(generator, prompt), _tokens(generator, completion), group)
        for group, (prompt, completion) in enumerate(shapes)
    ]
    if not top_k:
        return rows
    numbers = np.random.default_rng(5)
    return [
        dataclasses.replace(
            row,
            teacher_top_ids=np.stack(
                [numbers.permutation(VOCAB)[:top_k] for _ in row.completion_token_ids]
            ).astype(np.int32),
            teacher_top_logprobs=np.log(numbers.dirichlet(np.ones(top_k + 1), len(row.completion_token_ids)))[
                :, :top_k
            ].astype(np.float32),
        )
        for row in rows
    ]


def _loss_and_grads(
    model: torch.nn.Module,
    batch: LearnerBatch,
    estimator: str,
    packed: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The learner's loss on `batch` through the plain forward (packed, or forced padded), its scored
    logits and the parameters' gradients."""
    top_k = TOP_K if estimator != "sampled" else 0
    settings = learner_settings(distill_loss=estimator, teacher_top_k=top_k)
    with monkeypatch.context() as patch:
        if not packed:
            patch.setattr(learner_batch, "packing_saves", lambda batch, config: False)
        model.zero_grad()
        logits_B_S_V = scored_logits(model, batch, None, CPU)
    learner_B_T = logprobs_of_targets(logits_B_S_V, batch, settings.temperature)
    advantages_B = torch.linspace(-1.0, 1.0, len(batch.lengths))
    inputs = batch.distillation_inputs(logits_B_S_V, learner_B_T, advantages_B, None)
    loss, _ = distillation_loss(settings.distillation, inputs)
    loss.backward()
    return loss.detach(), logits_B_S_V.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("estimator", "attention", "checkpointing"),
    [
        ("sampled", "sdpa", False),
        ("sampled", "eager", False),
        # As the learner runs it: checkpointed layers are what send it to the plain forward.
        ("sampled", "sdpa", True),
        # Reads the logits over the vocabulary, the slots past each row's completion included.
        ("topk_reverse", "sdpa", False),
    ],
)
@pytest.mark.parametrize("preamble", [False, True])
def test_the_packed_forward_equals_the_padded_in_loss_and_gradients(
    preamble: bool, estimator: str, attention: str, checkpointing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    model.set_attn_implementation(attention)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    top_k = TOP_K if estimator != "sampled" else 0
    batch = pad_segments(_ragged(preamble, top_k), top_k, CPU)
    assert packing_saves(batch, model.config)
    padded_loss, padded_logits, padded_grads = _loss_and_grads(model, batch, estimator, False, monkeypatch)
    packed_loss, packed_logits, packed_grads = _loss_and_grads(model, batch, estimator, True, monkeypatch)
    assert padded_loss.abs() > 1e-3  # a loss that reads the logits
    assert packed_logits.shape == padded_logits.shape
    scored = batch.completion_mask_B_T[:, batch.first_scored_position :].bool()
    torch.testing.assert_close(packed_logits[scored], padded_logits[scored], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_loss, padded_loss, rtol=0, atol=1e-5)
    for (name, _), want, got in zip(model.named_parameters(), padded_grads, packed_grads, strict=True):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


def test_rows_of_equal_length_take_the_padded_forward() -> None:
    generator = torch.Generator().manual_seed(6)
    segments = [_call(_tokens(generator, 7), _tokens(generator, 5)) for _ in range(3)]
    batch = pad_segments(segments, 0, CPU)
    model = _model()
    assert not packing_saves(batch, model.config)
    calls: list[dict[str, object]] = []
    model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs), with_kwargs=True)
    scored_logits(model, batch, None, CPU)
    # The padded forward: the [B, W] batch with its mask.
    assert calls[0]["attention_mask"] is batch.attention_B_T
    assert calls[0]["input_ids"].shape == batch.input_ids_B_T.shape


def test_ragged_rows_take_the_packed_forward_of_their_own_tokens() -> None:
    batch = pad_segments(_ragged(preamble=True), 0, CPU)
    model = _model()
    calls: list[dict[str, object]] = []
    model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs), with_kwargs=True)
    scored_logits(model, batch, None, CPU)
    assert calls[0]["attention_mask"] is None
    assert calls[0]["input_ids"].shape == (1, sum(batch.lengths))
    restarts = (calls[0]["position_ids"][0] == 0).nonzero().flatten().tolist()
    assert restarts == [sum(batch.lengths[:row]) for row in range(len(batch.lengths))]


def test_an_attention_without_packed_masks_takes_the_padded_forward() -> None:
    batch = pad_segments(_ragged(preamble=False), 0, CPU)
    config = _model().config
    config._attn_implementation = "flex_attention"
    assert not packing_saves(batch, config)
    assert not packing_saves(batch, None)
