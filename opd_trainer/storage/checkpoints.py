"""Checkpoints of a run: `step-N/` folders written whole, and a `latest` pointer flipped last.

A folder is built under a staging name and renamed into place, then `latest` is replaced
atomically, so a process killed at any moment leaves the previous checkpoint as the latest one.

A save that fails (`saving`) leaves nothing behind: its staging folder is removed, and one that failed
because the file system is full (or the quota spent) is reported as such (`disk_full_error`): where,
how much the previous checkpoint took and how much is free. Every write that needs space happens before
the rename, so a full disk can never leave `latest` pointing at a checkpoint half written.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from opd_trainer.errors import OPDError, exception_chain
from opd_trainer.wire.checkpoint import CheckpointState, PromotionDecision

STATE_FILE = "driver_state.json"
# The promotion decision (`driver/promotion.py`): which checkpoint is the job's model, and why.
PROMOTED_FILE = "promoted.json"
STAGING_PREFIX = ".staging-"
POINTER_STAGING = "latest.tmp"
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# How writers that do not raise an OSError say it: safetensors (Rust's io::Error: "No space left on
# device (os error 28)"), libraries that print strerror.
DISK_FULL_TEXTS = tuple(os.strerror(code) for code in sorted(DISK_FULL_ERRNOS)) + tuple(
    f"os error {code}" for code in sorted(DISK_FULL_ERRNOS)
)
# torch.save on a full disk raises a RuntimeError that names no cause ("unexpected pos 576 vs 534"):
# a save that failed while less than this was free on its file system counts as a full disk
# (`nearly_full`).
NEARLY_FULL_BYTES = 16 * 1024 * 1024


class CheckpointStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def name(step: int) -> str:
        return f"step-{step:06d}"

    def staging(self, step: int) -> Path:
        """An empty folder to write checkpoint `step` into before `commit`. What earlier saves left
        (a process killed while saving) is removed first: one save at a time writes a run's checkpoints."""
        for leftover in self.root.glob(f"{STAGING_PREFIX}*"):
            self.discard(leftover)
        path = self.root / f"{STAGING_PREFIX}{self.name(step)}"
        path.mkdir(parents=True)
        return path

    def commit(self, staging: Path, state: CheckpointState) -> Path:
        """Makes `staging` checkpoint `state.step` (`state` its `driver_state.json`) and the latest."""
        (staging / STATE_FILE).write_text(json.dumps(state.model_dump(), indent=2))
        final = self.root / self.name(state.step)
        pointer = self.root / POINTER_STAGING
        pointer.write_text(final.name)  # written before the rename: a full disk fails it here
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        os.replace(pointer, self.root / "latest")
        return final

    def discard(self, staging: Path) -> None:
        """Removes a staging folder a save failed to fill or commit (and the pointer it may have begun);
        the committed checkpoints and `latest` are untouched."""
        shutil.rmtree(staging, ignore_errors=True)
        (self.root / POINTER_STAGING).unlink(missing_ok=True)

    @contextmanager
    def saving(self, step: int) -> Iterator[Path]:
        """The staging folder of checkpoint `step`, for the body to write and `commit`. When the body
        raises, the folder is removed, and a disk found full raises `disk_full_error`'s error (from the
        original) instead; the previous checkpoint stays the latest. A sync context manager, so that
        an async driver's `with` may await the learner's save inside it."""
        staging = self.staging(step)
        try:
            yield staging
        except BaseException as exc:  # a cancelled save (a timeout) leaves nothing behind either
            written = tree_bytes(staging)
            full_now = nearly_full(self.root)
            self.discard(staging)
            full = None
            if isinstance(exc, Exception):
                full = self.disk_full_error(exc, staging, step, written=written, nearly_full=full_now)
            if full is not None:
                raise full from exc
            raise

    def disk_full_error(
        self, exc: BaseException, staging: Path, step: int, *, written: int = 0, nearly_full: bool = False
    ) -> OPDError | None:
        """The job's error for a checkpoint save that failed with `exc` because the file system under
        `staging` is full or its quota spent (`disk_full_cause`; or `nearly_full`, measured when the save
        failed: torch's writer names no cause); None for any other failure.

        It names the file system and the staging path, what the save needs (the latest checkpoint's
        size: the next one is as large; before the first, at least what was `written`) and what is
        free now."""
        cause = disk_full_cause(exc)
        if cause is None and not nearly_full:
            return None
        latest = self.latest()
        if latest is not None:
            needed = tree_bytes(latest[0])
            need = f"about {_size(needed)}, the size of the previous checkpoint ({latest[0].name})"
        else:
            need = f"more than the {_size(written)} it had written"
        free = free_bytes(staging.parent)
        reason = cause if cause is not None else exc
        what = (str(reason).strip().splitlines() or [""])[0][:300]
        kept = (
            f"the previous checkpoint ({latest[0].name}) is intact and stays the latest"
            if latest is not None
            else "there is no earlier checkpoint"
        )
        return OPDError(
            f"no space left to save the checkpoint of step {step} on the file system of "
            f"{mount_point(staging.parent)} ({staging}): it needs {need}; {_size(free)} free\n"
            f"The half-written checkpoint was removed and {kept}. Free space there, give the run "
            "directory a larger volume, or keep fewer checkpoints (hyper_parameters.keep_last_n).\n"
            f"The save failed with {type(reason).__name__}: {what}"
        )

    def latest(self) -> tuple[Path, CheckpointState] | None:
        """The latest committed checkpoint's folder and state; None before the first."""
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        state_file = path / STATE_FILE
        if not state_file.exists():
            return None
        return path, CheckpointState.model_validate_json(state_file.read_text())

    def latest_step(self) -> int | None:
        latest = self.latest()
        return None if latest is None else latest[1].step

    def list(self) -> list[dict[str, Any]]:
        """Every committed checkpoint, oldest first: id (its folder name), step, when it was committed,
        path, student model folder."""
        found = []
        for path in sorted(self.root.glob("step-*")):
            state_file = path / STATE_FILE
            if state_file.exists():
                step = CheckpointState.model_validate_json(state_file.read_text()).step
                found.append(
                    {
                        "id": path.name,
                        "step": step,
                        "created_at": int(state_file.stat().st_mtime),
                        "path": str(path),
                        "student": str(path / "student"),
                    }
                )
        return found

    def promote(self, decision: PromotionDecision) -> None:
        """Records the promotion decision (`checkpoint`: a checkpoint id, or None when no validation met
        the gate), replacing the previous one atomically."""
        staging = self.root / f"{PROMOTED_FILE}.tmp"
        staging.write_text(json.dumps(decision.model_dump(), indent=2))
        os.replace(staging, self.root / PROMOTED_FILE)

    def prune(self, keep_last_n: int) -> list[str]:
        """Removes all but the newest `keep_last_n` checkpoints; the latest and the promoted one always
        stay. Returns the ids removed."""
        promoted = read_promoted(self.root)
        keep = {promoted.checkpoint} if promoted is not None else set()
        latest = self.latest()
        if latest is not None:
            keep.add(latest[0].name)
        found = [c["id"] for c in self.list()]
        removed = [name for name in found[: max(0, len(found) - keep_last_n)] if name not in keep]
        for name in removed:
            shutil.rmtree(self.root / name, ignore_errors=True)
        return removed


def disk_full_cause(exc: BaseException) -> BaseException | None:
    """The error in `exc`, its causes and contexts, the cause a Ray `RayTaskError` carries (`.cause`:
    what a learner rank raised) and an exception group's members, that says a file system is full or a
    quota spent: an `OSError` with ENOSPC or EDQUOT, or an error whose text says it (safetensors)."""
    for found in exception_chain(exc):
        if isinstance(found, OSError) and found.errno in DISK_FULL_ERRNOS:
            return found
        # A RayTaskError re-raised as its cause's class is an OSError too, without the errno: its
        # `.cause` has it. Its text is the remote traceback, which quotes the cause's.
        if not hasattr(found, "cause") and any(text in str(found) for text in DISK_FULL_TEXTS):
            return found
    return None


def tree_bytes(path: Path) -> int:
    """The bytes of the files under `path` (0 when it is gone)."""
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on `path`'s file system."""
    return shutil.disk_usage(path).free


def mount_point(path: Path) -> Path:
    """The mount point of the file system `path` is on."""
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def nearly_full(path: Path) -> bool:
    """Whether `path`'s file system has less than `NEARLY_FULL_BYTES` (or 1 % of its size, on a small
    one) free."""
    usage = shutil.disk_usage(path)
    return usage.free < min(NEARLY_FULL_BYTES, usage.total // 100)


def _size(count: int) -> str:
    if count < 1024:
        return f"{count} bytes"
    value = float(count)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit} ({count} bytes)"


def read_promoted(root: Path) -> PromotionDecision | None:
    """The promotion decision under a checkpoints folder, or None when there is none (read-only)."""
    try:
        return PromotionDecision.model_validate_json((root / PROMOTED_FILE).read_text())
    except (OSError, ValidationError):
        return None
