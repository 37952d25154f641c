"""A job's run directory, the one definition of its layout: the driver writes it, the server and CLI read it.

    metrics.jsonl       one record per training step (`kind: train`) and per validation (`kind: eval`)
    events.jsonl        the driver's events (status, progress, errors: `wire.driver.DriverEvent`), in
                        order; each student validation pass's per-sample outcomes in an `eval_outcomes` event
                        (`driver/validation.py`: `validation_outcomes`; read by `validation_outcomes`)
    trajectories.jsonl  rollouts as the user's agent saw them (messages, tool calls, rewards, spans) and
                        the teacher's view of each trained token (`RolloutResult.trajectory`)
    validation_trajectories.jsonl   the first rollouts of each validation pass (`step`, `label`,
                        `model`: student or teacher, the evaluator's score; `driver/validation.py`)
    summary.json        the final validation summary
    usage.json          what the job used so far, over all its runs (`driver/metering.py`)
    recoveries.jsonl    the job's recoveries from lost components (`driver/recovery.py`)
    checkpoints/        `step-N/` folders (each with its `driver_state.json`), a `latest` pointer and the
                        promotion decision, `promoted.json` (`storage/checkpoints.py`, `wire/checkpoint.py`)
    tensorboard/        the same metrics for TensorBoard (`report_to: [tensorboard]`, driver/trackers.py)
    mlflow.db, mlflow_run_id   `report_to: [mlflow]`: the default local store and the job's MLflow run
    curves.png          the plotted curves (`opd train`, `opd submit --follow`)

Reading tolerates a file the driver is still writing (a missing file is empty, a half-written last
line is skipped), so the server can read while a job runs, and events another build wrote
(`wire.driver.driver_events`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from opd_trainer.jsonl import read_jsonl, write_jsonl
from opd_trainer.storage.checkpoints import CheckpointStore, read_promoted
from opd_trainer.wire.checkpoint import PromotionDecision
from opd_trainer.wire.driver import DriverEvent, ValidationSummary, driver_events


class RunDir:
    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.metrics_path = self.root / "metrics.jsonl"
        self.events_path = self.root / "events.jsonl"
        self.trajectories_path = self.root / "trajectories.jsonl"
        self.validation_trajectories_path = self.root / "validation_trajectories.jsonl"
        self.summary_path = self.root / "summary.json"
        self.usage_path = self.root / "usage.json"
        self.checkpoints_path = self.root / "checkpoints"
        self.tensorboard_path = self.root / "tensorboard"
        self.curves_path = self.root / "curves.png"
        self.mlflow_run_id_path = self.root / "mlflow_run_id"
        self.mlflow_store_path = self.root / "mlflow.db"

    # -- reading (server, CLI, tests) ------------------------------------------------------------

    def records(self) -> list[dict[str, Any]]:
        """Every metrics record, training and validation, in the order written."""
        return read_jsonl(self.metrics_path)

    def events(self, start: int = 0) -> list[DriverEvent]:
        """The driver's events from line `start` of events.jsonl on (`event_count()` before a driver
        started: its own), in order; a line that is no event (half written) is skipped."""
        if not self.events_path.is_file():
            return []
        lines = self.events_path.read_text(encoding="utf-8", errors="replace").split("\n")[start:]
        records = (record for record in map(_json_object, lines) if record is not None)
        return driver_events(records, str(self.events_path))

    def event_count(self) -> int:
        """The whole lines events.jsonl holds, unparsed: the line the next event written starts on."""
        if not self.events_path.is_file():
            return 0
        with self.events_path.open("rb") as lines:
            return sum(block.count(b"\n") for block in iter(lambda: lines.read(1 << 20), b""))

    def validation_outcomes(self) -> list[dict[str, Any]]:
        """Each student validation pass's per-sample outcomes, in the order run: `{label, time,
        outcomes}` (`outcomes`: one dict per validation sample, `driver/validation.validation_outcomes`).
        A pass redone after a recovery appears again, under the same label."""
        return [
            {"label": e.data.get("label"), "time": e.time, "outcomes": e.data.get("outcomes", [])}
            for e in self.events()
            if e.type == "eval_outcomes"
        ]

    def recent_trajectories(self, limit: int) -> list[dict[str, Any]]:
        return read_jsonl(self.trajectories_path, tail=limit)

    def trajectory_steps(self) -> list[int]:
        """The steps that have trajectories, ascending (each line's step is read from its start)."""
        return sorted({step for step, _ in self._trajectory_lines()})

    def step_trajectories(self, step: int | None = None) -> list[dict[str, Any]]:
        """The trajectories of `step` (None: all), in the order written; only that step's lines are
        parsed whole, as the file grows by every step's tokens."""
        chosen = (line for line_step, line in self._trajectory_lines() if step is None or line_step == step)
        return [record for record in map(_json_object, chosen) if record is not None]

    def _trajectory_lines(self) -> Iterator[tuple[int, str]]:
        """Each trajectory line with its `step` (a record starts with it: `RolloutResult.trajectory`)."""
        if not self.trajectories_path.is_file():
            return
        with self.trajectories_path.open(encoding="utf-8", errors="replace") as lines:
            for line in lines:
                line_step = _leading_step(line)
                if line_step is not None:
                    yield line_step, line

    def validation_passes(self) -> list[dict[str, Any]]:
        """Each validation pass recorded, as `{step, label, model}` in the order written."""
        return validation_passes_of(self.validation_trajectories())

    def validation_trajectories(self, step: int | None = None) -> list[dict[str, Any]]:
        """The recorded validation rollouts of `step` (None: every step), in the order written."""
        records = read_jsonl(self.validation_trajectories_path)
        return [r for r in records if step is None or r.get("step") == step]

    def load_summary(self) -> ValidationSummary:
        """The final summary; empty while it is not written yet (or caught mid-write)."""
        try:
            return json.loads(self.summary_path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def usage(self) -> dict[str, float]:
        """What the job used so far (`driver/metering.py`); empty before its first step."""
        try:
            found = json.loads(self.usage_path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        return found if isinstance(found, dict) else {}

    def checkpoints(self) -> list[dict[str, Any]]:
        return self.checkpoint_store().list() if self.checkpoints_path.is_dir() else []

    def latest_checkpoint_id(self) -> str | None:
        """The folder name of the latest committed checkpoint (read-only: creates nothing)."""
        pointer = self.checkpoints_path / "latest"
        return pointer.read_text().strip() or None if pointer.is_file() else None

    def promoted(self) -> PromotionDecision | None:
        """The promotion decision so far, or None for a job that does not promote (no validation data)."""
        return read_promoted(self.checkpoints_path)

    def fine_tuned_model_id(self) -> str | None:
        """The checkpoint a finished job hands out: the promoted one when the job promotes (None when no
        validation met its gate), else the latest."""
        promoted = self.promoted()
        return promoted.checkpoint if promoted is not None else self.latest_checkpoint_id()

    def checkpoint_store(self) -> CheckpointStore:
        return CheckpointStore(self.checkpoints_path)

    # -- writing (the driver) --------------------------------------------------------------------

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self._record("train", step, metrics)

    def eval(self, step: int, metrics: dict[str, float]) -> None:
        self._record("eval", step, metrics)

    def _record(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        write_jsonl(self.metrics_path, [{"kind": kind, "step": step, **metrics}], append=True)

    def event(self, event: DriverEvent) -> None:
        write_jsonl(self.events_path, [event.model_dump()], append=True)

    def trajectories(self, trajectories: list[dict[str, Any]]) -> None:
        write_jsonl(self.trajectories_path, trajectories, append=True)

    def add_validation_trajectories(self, records: list[dict[str, Any]]) -> None:
        """Appends one validation pass's recorded rollouts (`driver/validation.py` builds them)."""
        write_jsonl(self.validation_trajectories_path, records, append=True)

    def truncate_after(self, step: int) -> list[int]:
        """Drops the metrics, trajectories and validation trajectories of steps past `step` (a resumed
        run redoes them from its checkpoint) and returns the training steps dropped, so the resume can
        say which ones it discards."""
        records = self.records()
        dropped = sorted({r["step"] for r in records if r["step"] > step and r["kind"] == "train"})
        write_jsonl(self.metrics_path, [r for r in records if r["step"] <= step])
        for path in (self.trajectories_path, self.validation_trajectories_path):
            if path.exists():
                write_jsonl(path, [t for t in read_jsonl(path) if t["step"] <= step])
        return dropped

    def save_summary(self, summary: ValidationSummary) -> None:
        self.summary_path.write_text(json.dumps(summary, indent=2))

    def save_usage(self, usage: dict[str, float]) -> None:
        """Replaces usage.json at once (a reader never sees half of it)."""
        staging = self.usage_path.with_suffix(".json.tmp")
        staging.write_text(json.dumps(usage, indent=2))
        os.replace(staging, self.usage_path)


_LEADING_STEP = re.compile(r'^\{"step": (-?\d+)[,}]')


def validation_passes_of(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The passes (`{step, label, model}`, in the order written) that validation records belong to."""
    passes: dict[tuple[Any, ...], dict[str, Any]] = {}
    for record in records:
        found = {key: record.get(key) for key in ("step", "label", "model")}
        passes.setdefault(tuple(found.values()), found)
    return list(passes.values())


def _json_object(line: str) -> dict[str, Any] | None:
    """The line's JSON object; None for anything else (a half-written last line)."""
    try:
        found = json.loads(line)
    except json.JSONDecodeError:
        return None
    return found if isinstance(found, dict) else None


def _leading_step(line: str) -> int | None:
    """A trajectory line's `step`, read from its start when the record begins with it, else parsed."""
    match = _LEADING_STEP.match(line)
    if match is not None:
        return int(match.group(1))
    record = _json_object(line)
    step = record.get("step") if record is not None else None
    return step if isinstance(step, int) else None
