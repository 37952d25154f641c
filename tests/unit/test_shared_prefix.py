"""The shared-prefix forward (learner/shared_prefix.py) and the plain padded forward equal each row
forwarded alone.

A tiny random Qwen2 model (transformers, no DeepSpeed): logits at every scored position and the
parameter gradients of a loss over them match the per-row forward's within float tolerance.
"""

from __future__ import annotations

import pytest
import torch

from opd_trainer.learner.batch import LearnerBatch, pad_segments, prefix_plan, scored_logits
from opd_trainer.learner.shared_prefix import plan_prefixes
from opd_trainer.records import LLMCall

VOCAB = 50


def _model() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).float()


def _call(prompt: list[int], completion: list[int], group: int = 0) -> LLMCall:
    return LLMCall(
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        sampler_logprobs=[-1.0] * len(completion),
        teacher_logprobs=[-1.0] * len(completion),
        group_id=group,
        rollout_id=0,
    )


def _batches() -> dict[str, list[LLMCall]]:
    generator = torch.Generator().manual_seed(3)

    def tokens(length: int) -> list[int]:
        return torch.randint(1, VOCAB, (length,), generator=generator).tolist()

    system = tokens(17)
    questions = [tokens(length) for length in (5, 9, 2)]
    return {
        # A system preamble shared by every prompt, several completions per prompt, ragged lengths.
        "preamble_and_groups": [
            _call(system + q, tokens(c), g) for g, q in enumerate(questions) for c in (1, 4, 7)
        ],
        # Prompts that share nothing: level 1 empty, every group its own prompt.
        "no_common_prefix": [
            _call(tokens(6), tokens(3)),
            _call(tokens(11), tokens(5)),
            _call(tokens(3), tokens(2)),
        ],
        # One prompt, its completions: level 2 empty.
        "one_prompt": [_call(system, tokens(c)) for c in (2, 6, 3)],
        # One prompt extends another (a multi-turn history and its earlier turn).
        "nested_prompts": [_call(system, tokens(4)), _call(system + questions[0], tokens(3))],
        # A prompt's rows not next to each other, and groups of unequal size.
        "interleaved_groups": [
            _call(system + questions[g], tokens(c), g) for g, c in ((0, 3), (1, 5), (0, 2), (2, 4), (1, 1))
        ],
    }


def _per_row_logits(model: torch.nn.Module, segments: list[LLMCall], batch: LearnerBatch) -> torch.Tensor:
    """The reference: each row forwarded alone, unpadded; its logits that predict its completion placed
    where the batch's scored logits hold them ([B, S, V], row's completion token j at column j)."""
    width = batch.targets_B_T.shape[1] - batch.first_scored_position
    rows = []
    for segment in segments:
        prompt, completion = segment.prompt_token_ids, segment.completion_token_ids
        ids = torch.tensor([prompt + completion])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(completion)]
        rows.append(torch.nn.functional.pad(logits, (0, 0, 0, width - len(completion))))
    return torch.stack(rows).float()


@pytest.mark.parametrize("case", list(_batches()))
@pytest.mark.parametrize("forward", ["shared_prefix", "padded"])
def test_the_batch_forward_equals_each_row_alone_in_logits_and_gradients(case: str, forward: str) -> None:
    """The shared-prefix forward and the plain padded one (prompts padded before their start) both
    match each row forwarded alone: the logits at every scored position and the parameter gradients
    of a loss over them."""
    model = _model()
    cpu = torch.device("cpu")
    segments = _batches()[case]
    batch = pad_segments(segments, 0, cpu)
    plan = prefix_plan(batch)
    assert plan is not None
    mask = batch.mask_B_T[:, batch.first_scored_position :]

    def batch_logits() -> torch.Tensor:
        return scored_logits(model, batch, plan if forward == "shared_prefix" else None, cpu)

    def loss_and_grads(logits_B_S_V: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        logprobs = torch.log_softmax(logits_B_S_V, dim=-1)
        weights = torch.linspace(0.1, 1.0, VOCAB)
        loss = ((logprobs * weights).sum(-1) * mask).sum() / mask.sum()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    alone = _per_row_logits(model, segments, batch)
    batched = batch_logits()
    assert batched.shape == alone.shape
    assert torch.isfinite(batched).all()
    scored = mask.bool()
    torch.testing.assert_close(batched[scored], alone[scored], rtol=1e-4, atol=1e-4)
    alone_loss, alone_grads = loss_and_grads(_per_row_logits(model, segments, batch))
    batched_loss, batched_grads = loss_and_grads(batch_logits())
    torch.testing.assert_close(batched_loss, alone_loss, rtol=1e-5, atol=1e-5)
    for (name, _), want, got in zip(model.named_parameters(), alone_grads, batched_grads, strict=True):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5, msg=name)


def test_plan_forwards_each_shared_prefix_once() -> None:
    system, question_a, question_b = [1] * 100, [2, 3, 4], [5, 6]
    prompts = [system + question_a] * 4 + [system + question_b] * 4
    completions = [[7] * 10] * 8
    plan = plan_prefixes(prompts, completions)
    assert plan is not None
    assert plan.shared_ids == system
    assert plan.group_ids == [question_a[:-1], question_b[:-1]]
    assert plan.group_of_row == [0] * 4 + [1] * 4
    assert plan.row_start == [102] * 4 + [101] * 4
    # 100 + (2 + 1) + 8 × 10 tokens instead of 8 × 112.
    assert plan.forwarded_tokens == 183


def test_a_one_token_prompt_takes_the_plain_forward() -> None:
    assert plan_prefixes([[4], [4, 5]], [[1], [2]]) is None
