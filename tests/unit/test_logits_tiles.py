"""`loss.by_tiles`: the vocabulary-wide functions over tiles of the logits (rows, or positions of a row)
equal the whole-tensor ones, values and gradients, to 1e-6."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from opd_trainer.learner import loss


def _whole_and_tiled(
    monkeypatch: pytest.MonkeyPatch, tile_bytes: int, function: Callable[..., torch.Tensor]
) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 50, generator=generator) * 3).requires_grad_()
    ids = torch.randint(0, 50, (3, 7), generator=generator)
    top_ids = torch.stack([torch.randperm(50, generator=generator)[:4] for _ in range(21)]).reshape(3, 7, 4)
    weights = torch.randn(3, 7, 5, generator=generator)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        logits.grad = None
        value = function(logits, ids, top_ids)
        (
            value * weights[..., : value.shape[-1]] if value.dim() == 3 else value * weights[..., 0]
        ).sum().backward()
        return value.detach(), logits.grad.clone()

    whole_value, whole_grad = run()
    monkeypatch.setattr(loss, "LOGITS_TILE_BYTES", tile_bytes)
    tiled_value, tiled_grad = run()
    torch.testing.assert_close(tiled_value, whole_value, rtol=0, atol=1e-6)
    torch.testing.assert_close(tiled_grad, whole_grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("tile_bytes", [4 * 50 * 14, 4 * 50 * 3, 1])  # two rows, 3 positions, 1 position
@pytest.mark.parametrize(
    "function",
    [
        lambda logits, ids, top: loss.gather_token_logprobs(logits, ids, 1.0),
        lambda logits, ids, top: loss.gather_token_logprobs(logits, ids, 0.7),
        lambda logits, ids, top: loss.student_bucket_logprobs(logits, top),
    ],
    ids=["logprobs", "logprobs_at_0.7", "buckets"],
)
def test_tiles_equal_the_whole_tensor(
    monkeypatch: pytest.MonkeyPatch, tile_bytes: int, function: Callable[..., torch.Tensor]
) -> None:
    _whole_and_tiled(monkeypatch, tile_bytes, function)


def test_the_baseline_tiles_too(monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 40, generator=generator)
    top_ids = torch.stack([torch.randperm(40, generator=generator)[:3] for _ in range(10)]).reshape(2, 5, 3)
    top_logprobs = torch.log_softmax(torch.randn(2, 5, 3, generator=generator), -1) - 0.5
    mask = torch.ones(2, 5)
    whole = loss.topk_signal_baseline(logits, top_ids, top_logprobs, mask)
    monkeypatch.setattr(loss, "LOGITS_TILE_BYTES", 4 * 40 * 2)
    torch.testing.assert_close(
        loss.topk_signal_baseline(logits, top_ids, top_logprobs, mask), whole, rtol=0, atol=1e-6
    )
