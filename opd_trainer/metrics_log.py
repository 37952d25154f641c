"""A run's records on disk: per-step metrics (JSONL + TensorBoard), events, and the eval summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.events_path = run_dir / "events.jsonl"
        self.summary_path = run_dir / "summary.json"
        self.trajectories_path = run_dir / "trajectories.jsonl"
        self._tensorboard: Any = None

    def _writer(self) -> Any:
        if self._tensorboard is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"))
        return self._tensorboard

    def _append(self, path: Path, record: dict[str, Any]) -> None:
        with path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self._append(self.metrics_path, {"kind": "train", "step": step, **metrics})
        writer = self._writer()
        for name, value in metrics.items():
            writer.add_scalar(f"train/{name}", value, step)
        writer.flush()

    def eval(self, step: int, metrics: dict[str, float]) -> None:
        self._append(self.metrics_path, {"kind": "eval", "step": step, **metrics})
        writer = self._writer()
        for name, value in metrics.items():
            writer.add_scalar(f"eval/{name}", value, step)
        writer.flush()

    def event(self, event: dict[str, Any]) -> None:
        self._append(self.events_path, event)

    def trajectories(self, trajectories: list[dict[str, Any]]) -> None:
        """Rollouts as the user's agent saw them: messages, tool calls, rewards, spans."""
        with self.trajectories_path.open("a") as handle:
            for trajectory in trajectories:
                handle.write(json.dumps(trajectory, ensure_ascii=False, default=str) + "\n")

    def records(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> list[int]:
        """Drops the metrics and trajectories of steps past `step` (a resumed run redoes them from its
        checkpoint) and returns the steps dropped, so the resume can say which ones it discards."""
        records = self.records()
        dropped = sorted({r["step"] for r in records if r["step"] > step and r["kind"] == "train"})
        kept = [r for r in records if r["step"] <= step]
        self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        if self.trajectories_path.exists():
            lines = self.trajectories_path.read_text().splitlines()
            kept_lines = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
            self.trajectories_path.write_text("".join(line + "\n" for line in kept_lines))
        return dropped

    def save_summary(self, summary: dict[str, Any]) -> None:
        self.summary_path.write_text(json.dumps(summary, indent=2))

    def load_summary(self) -> dict[str, Any]:
        return json.loads(self.summary_path.read_text()) if self.summary_path.exists() else {}
