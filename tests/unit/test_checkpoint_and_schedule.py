"""Checkpoint store atomicity and the learning-rate schedule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opd_trainer.learner.settings import lr_schedule
from opd_trainer.storage.checkpoints import CheckpointStore
from opd_trainer.wire.checkpoint import CheckpointState, CursorState


def _state(step: int) -> CheckpointState:
    """A checkpoint's driver state at `step` (what the store writes beside the learner's files)."""
    return CheckpointState(step=step, cursor=CursorState(epoch=0, position=step), total_steps=step)


def test_latest_flips_only_on_commit(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    assert store.latest() is None
    first = store.staging(2)
    (first / "weights").write_text("a")
    store.commit(first, _state(2))
    half_written = store.staging(4)
    (half_written / "weights").write_text("b")  # a crash here must leave step 2 as latest
    latest = store.latest()
    assert latest is not None and latest[1] == _state(2) and (latest[0] / "weights").read_text() == "a"
    store.commit(half_written, _state(4))
    assert store.latest_step() == 4
    assert [c["step"] for c in store.list()] == [2, 4]


@pytest.mark.parametrize(
    ("update", "schedule", "expected"),
    [
        (0, "cosine", 0.0),  # warm-up: 0/4
        (1, "cosine", 0.25),
        (4, "cosine", 1.0),  # decay starts at 1
        (14, "cosine", 0.5),  # half way through 20 decay updates
        (24, "cosine", 0.0),
        (14, "linear", 0.5),
        (2, "constant", 0.5),
        (24, "constant", 1.0),
    ],
)
def test_lr_schedule(update: int, schedule: str, expected: float) -> None:
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([parameter], lr=2.0)
    scheduler = lr_schedule(optimizer, schedule, total_updates=24, warmup_updates=4)
    for _ in range(update):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2.0 * expected)
