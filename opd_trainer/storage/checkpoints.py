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
