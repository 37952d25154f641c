"""Checkpoints of a run: `step-N/` folders written whole, and a `latest` pointer flipped last.

A folder is built under a staging name and renamed into place, then `latest` is replaced
atomically, so a process killed at any moment leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

STATE_FILE = "driver_state.json"
# The promotion decision (`driver/promotion.py`): which checkpoint is the job's model, and why.
PROMOTED_FILE = "promoted.json"


class CheckpointStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def name(step: int) -> str:
        return f"step-{step:06d}"

    def staging(self, step: int) -> Path:
        """An empty folder to write checkpoint `step` into before `commit`."""
        path = self.root / f".staging-{self.name(step)}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def commit(self, staging: Path, step: int, state: dict[str, Any]) -> Path:
        (staging / STATE_FILE).write_text(json.dumps(state, indent=2))
        final = self.root / self.name(step)
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        pointer = self.root / "latest.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, self.root / "latest")
        return final

    def latest(self) -> tuple[Path, dict[str, Any]] | None:
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        state_file = path / STATE_FILE
        if not state_file.exists():
            return None
        return path, json.loads(state_file.read_text())

    def latest_step(self) -> int | None:
        latest = self.latest()
        return None if latest is None else int(latest[1]["step"])

    def list(self) -> list[dict[str, Any]]:
        """Every committed checkpoint, oldest first: id (its folder name), step, when it was committed,
        path, student model folder."""
        found = []
        for path in sorted(self.root.glob("step-*")):
            state_file = path / STATE_FILE
            if state_file.exists():
                step = int(json.loads(state_file.read_text())["step"])
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

    def promote(self, decision: dict[str, Any]) -> None:
        """Records the promotion decision (`checkpoint`: a checkpoint id, or None when no validation met
        the gate), replacing the previous one atomically."""
        staging = self.root / f"{PROMOTED_FILE}.tmp"
        staging.write_text(json.dumps(decision, indent=2))
        os.replace(staging, self.root / PROMOTED_FILE)

    def prune(self, keep_last_n: int) -> list[str]:
        """Removes all but the newest `keep_last_n` checkpoints; the latest and the promoted one always
        stay. Returns the ids removed."""
        promoted = read_promoted(self.root)
        keep = {promoted.get("checkpoint")} if promoted else set()
        latest = self.latest()
        if latest is not None:
            keep.add(latest[0].name)
        found = [c["id"] for c in self.list()]
        removed = [name for name in found[: max(0, len(found) - keep_last_n)] if name not in keep]
        for name in removed:
            shutil.rmtree(self.root / name, ignore_errors=True)
        return removed


def read_promoted(root: Path) -> dict[str, Any] | None:
    """The promotion decision under a checkpoints folder, or None when there is none (read-only)."""
    try:
        found = json.loads((root / PROMOTED_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return found if isinstance(found, dict) else None
