"""Unit tests for a run's records on disk after a resume: only the checkpointed steps are kept."""

from __future__ import annotations

import json
from pathlib import Path

from opd_trainer.storage.run_dir import RunDir


def test_truncate_after_drops_redone_steps_from_metrics_and_trajectories(tmp_path: Path) -> None:
    log = RunDir(tmp_path)
    log.eval(0, {"exact_match": 0.3})
    for step in (1, 2, 3):
        log.step(step, {"loss": float(step)})
        log.trajectories([{"step": step, "rollout_id": f"r{step}-{i}", "text": "é"} for i in range(2)])
    log.eval(2, {"exact_match": 0.5})

    assert log.truncate_after(1) == [2, 3]

    assert [(r["kind"], r["step"]) for r in log.records()] == [("eval", 0), ("train", 1)]
    lines = log.trajectories_path.read_text().splitlines()
    assert [json.loads(line)["rollout_id"] for line in lines] == ["r1-0", "r1-1"]
    assert json.loads(lines[0])["text"] == "é"
    # Nothing after the checkpoint: nothing to drop, and a run without trajectories is fine.
    assert log.truncate_after(1) == []
    (tmp_path / "empty").mkdir()
    assert RunDir(tmp_path / "empty").truncate_after(0) == []
