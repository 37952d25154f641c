"""Hindsight self-distillation end to end: `teacher_model: self` and `teacher_hindsight: reference` on
the real engines, learner and gateway. The teacher is the student's initial weights; only the
reference answer in its context sets it apart, so the first step's reverse KL measures that note alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from opd_trainer.cli.main import main
from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.jsonl import read_jsonl, write_jsonl
from opd_trainer.signal.notes import NOTE
from opd_trainer.storage.run_dir import RunDir


def test_the_initial_student_scores_its_own_samples_knowing_the_reference(
    ray_session: None, tiny_models: TinyModels, tmp_path: Path
) -> None:
    train = tmp_path / "train.jsonl"
    write_jsonl(train, read_jsonl(tiny_models.data_dir / "train.jsonl")[:8])
    job = tmp_path / "job.yaml"
    spec = {
        "job_name": "hindsight-self",
        "model": str(tiny_models.student),
        "teacher_model": "self",
        "training_datasets": [str(train)],
        "hyper_parameters": {
            "max_steps": 2,
            "batch_size": 4,
            "n_rollouts": 2,
            "max_tokens": 48,
            "teacher_hindsight": "reference",
        },
    }
    job.write_text(yaml.safe_dump(spec))
    run_dir = tmp_path / "run"
    assert main(["train", str(job), "--run-dir", str(run_dir)]) == 0
    records = [r for r in RunDir(run_dir).records() if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2]
    # Every call was scored with the note (the tiny template renders back each prompt exactly).
    assert all(r["hindsight/teacher_note_share"] == 1.0 for r in records), records
    # Two steps cannot teach the note's wording: the leakage check found none to drop.
    assert all(r["hindsight/leaked_rollouts"] == 0.0 for r in records), records
    # Same weights on both sides: without the note every token's log-ratio (sampler - teacher) is 0
    # (measured: the first step's KL 0.0 exactly, this job with `teacher_hindsight: none`); with it the
    # teacher's view moved, either way per token: step 1's mean |log-ratio| 0.125 (KL 0.060) on this
    # machine's build of the tiny models, 0.051 (KL -0.003) on the one ATEN_CPU_CAPABILITY=default builds.
    moved = [
        abs(ratio)
        for t in read_jsonl(run_dir / "trajectories.jsonl")
        if t["step"] == 1
        for call in t["llm_calls"]
        if call.get("tokens")
        for ratio in call["tokens"]["log_ratio"]
    ]
    assert moved and sum(moved) / len(moved) > 0.01, (sum(moved) / max(len(moved), 1), records[0])
    # What the student was sampled with (the rollouts' conversations) never holds the note.
    marker = NOTE.split(":")[0]
    trajectories = (run_dir / "trajectories.jsonl").read_text()
    assert trajectories and marker not in trajectories
    assert all(marker not in json.dumps(t["messages"]) for t in read_jsonl(run_dir / "trajectories.jsonl"))
