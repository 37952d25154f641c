"""A run directory whose disk fills up at a checkpoint (`CheckpointStore.saving`): the job's error says
where, how much the save needs and how much is free; the half-written staging folder is gone; the
previous checkpoint stays the latest, intact, and a later save works once there is room.

The disk is a real one: a small tmpfs mounted for the test (root only; skipped where mount is not
permitted), filled with real writes, so every ENOSPC below is the kernel's.
"""

from __future__ import annotations

import errno
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from opd_trainer.errors import OPDError
from opd_trainer.storage.checkpoints import POINTER_STAGING, STAGING_PREFIX, CheckpointStore, tree_bytes
from opd_trainer.wire.checkpoint import CheckpointState, CursorState

DISK_BYTES = 4 * 1024 * 1024
CHUNK = 64 * 1024
LEFT_FREE = 256 * 1024  # what the filler leaves: the second save gets part-way, then the disk is full


def _state(step: int) -> CheckpointState:
    """A checkpoint's driver state at `step` (what the store writes beside the learner's files)."""
    return CheckpointState(step=step, cursor=CursorState(epoch=0, position=step), total_steps=step)


@pytest.fixture
def small_disk(tmpfs: Any) -> Path:
    """A 4 MiB file system (`tmpfs` in tests/conftest.py)."""
    return tmpfs(DISK_BYTES)


def _write_until_full(folder: Path, limit: int | None = None) -> int:
    """Writes `folder/deepspeed/shard.pt` and `folder/student/model.safetensors` in chunks, as a learner
    rank would: `limit` bytes in all, or until the disk is full (then its OSError is raised); returns the
    bytes written."""
    written = 0
    for name in ("deepspeed/shard.pt", "student/model.safetensors"):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as out:
            part = 0
            while limit is None or part < limit // 2:
                out.write(os.urandom(CHUNK))
                out.flush()  # the kernel's ENOSPC surfaces on the write that does not fit
                part += CHUNK
        written += part
    return written


def _fill(disk: Path, leave: int) -> Path:
    """Fills `disk` with a file of its own, then gives back `leave` bytes of it."""
    filler = disk / "filler"
    with filler.open("wb") as out:
        try:
            while True:
                out.write(bytes(CHUNK))
                out.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    os.truncate(filler, max(0, filler.stat().st_size - leave))
    return filler


def _as_ray_task_error(exc: Exception) -> Exception:
    """What the driver's `await learner.save_checkpoint(...)` raises for a rank that raised `exc`."""
    from ray.exceptions import RayTaskError

    remote = "".join(traceback.format_exception(exc))
    return RayTaskError("Learner.save_checkpoint", remote, exc).as_instanceof_cause()


def _learner_save(staging: Path) -> None:
    _write_until_full(staging)


def _learner_save_over_ray(staging: Path) -> None:
    try:
        _write_until_full(staging)
    except OSError as exc:
        raise _as_ray_task_error(exc) from None


def _torch_save(staging: Path) -> None:
    """DeepSpeed's writer: torch.save fails on a full disk with a RuntimeError that names no errno."""
    import torch

    (staging / "deepspeed").mkdir()
    torch.save({"weights": torch.zeros(DISK_BYTES // 4)}, staging / "deepspeed" / "state.pt")


def _safetensors_save(staging: Path) -> None:
    """save_pretrained's writer: safetensors says 'No space left on device (os error 28)' in its text."""
    import torch
    from safetensors.torch import save_file

    (staging / "student").mkdir()
    save_file({"weights": torch.zeros(DISK_BYTES // 4)}, str(staging / "student" / "model.safetensors"))


def _no_leftovers(store: CheckpointStore) -> None:
    assert not list(store.root.glob(f"{STAGING_PREFIX}*"))
    assert not (store.root / POINTER_STAGING).exists()


@pytest.mark.parametrize(
    "save",
    [_learner_save, _learner_save_over_ray, _torch_save, _safetensors_save],
    ids=["oserror", "ray-task-error", "torch", "safetensors"],
)
def test_a_full_disk_at_a_checkpoint_is_a_clear_error_and_the_previous_checkpoint_stays(
    small_disk: Path, save: Callable[[Path], None]
) -> None:
    store = CheckpointStore(small_disk / "run" / "checkpoints")
    with store.saving(1) as staging:
        _write_until_full(staging, limit=8 * CHUNK)
        store.commit(staging, _state(1))
    first, _ = store.latest() or (None, None)
    assert first is not None
    first_files = {p.relative_to(first): p.read_bytes() for p in first.rglob("*") if p.is_file()}
    first_bytes = tree_bytes(first)
    filler = _fill(small_disk, LEFT_FREE)

    with pytest.raises(OPDError) as raised, store.saving(2) as staging:
        save(staging)
        store.commit(staging, _state(2))

    error = raised.value
    headline, *rest = error.message.splitlines()
    assert headline.startswith("no space left to save the checkpoint of step 2 on the file system of ")
    assert f"{small_disk} ({staging})" in headline  # the mount point, then the staging path
    assert f"({first_bytes} bytes), the size of the previous checkpoint (step-000001)" in headline
    assert headline.endswith(" free") and "bytes" in headline.rpartition(";")[2]
    assert "step-000001" in rest[0] and "keep_last_n" in rest[0]
    assert error.field is None
    assert error.__cause__ is not None  # the original failure stays attached
    # The half-written folder (and any pointer begun) is gone; the first checkpoint is the latest, whole.
    assert not staging.exists()
    _no_leftovers(store)
    latest = store.latest()
    assert latest is not None and latest[0] == first and latest[1].step == 1
    assert {p.relative_to(first): p.read_bytes() for p in first.rglob("*") if p.is_file()} == first_files
    assert [c["step"] for c in store.list()] == [1]

    # Room again: the next save commits and becomes the latest.
    filler.unlink()
    with store.saving(2) as staging:
        _write_until_full(staging, limit=8 * CHUNK)
        store.commit(staging, _state(2))
    assert store.latest_step() == 2
    _no_leftovers(store)


def test_the_first_checkpoint_failing_on_a_full_disk_says_what_it_had_written(small_disk: Path) -> None:
    store = CheckpointStore(small_disk / "checkpoints")
    _fill(small_disk, LEFT_FREE)
    with pytest.raises(OPDError) as raised, store.saving(1) as staging:
        _learner_save_over_ray(staging)
    headline = raised.value.message.splitlines()[0]
    assert "it needs more than the " in headline and " it had written; " in headline
    assert "there is no earlier checkpoint" in raised.value.message
    assert "OSError: [Errno 28] No space left on device" in raised.value.message
    assert store.latest() is None
    _no_leftovers(store)


def test_a_save_failing_for_another_reason_is_raised_as_it_was_and_leaves_nothing(small_disk: Path) -> None:
    store = CheckpointStore(small_disk / "checkpoints")
    with store.saving(1) as staging:
        _write_until_full(staging, limit=4 * CHUNK)
        store.commit(staging, _state(1))
    with pytest.raises(ValueError, match="a rank failed"), store.saving(2) as staging:
        _write_until_full(staging, limit=4 * CHUNK)
        raise ValueError("a rank failed")
    _no_leftovers(store)
    assert store.latest_step() == 1


def test_a_staging_folder_left_by_a_killed_save_is_removed_by_the_next_one(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    left = store.staging(3)
    (left / "deepspeed").mkdir()
    (left / "deepspeed" / "shard.pt").write_bytes(b"half")
    staging = store.staging(4)
    assert not left.exists() and staging.is_dir()
    store.commit(staging, _state(4))
    assert store.latest_step() == 4 and not list(store.root.glob(f"{STAGING_PREFIX}*"))
