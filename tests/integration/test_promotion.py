"""Promotion in real jobs: the best validation becomes the model, checkpointed between save_steps and
kept by retention, and a gate no validation meets leaves the job without a model.

The evaluator is scripted by validation (it reads the label in the rollout id: `eval-step-2`, ...), so
the job's curve rises to a peak at step 2 and falls after it whatever the tiny models learn; everything
else is real (engines, learner, pools, checkpoints)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import ray

from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.demo.tiny_models.serving import TINY_KV_CACHE_BYTES
from opd_trainer.driver.job_driver import JobDriver
from opd_trainer.jobspec.job_spec import parse_job_spec
from opd_trainer.jsonl import read_jsonl, write_jsonl
from opd_trainer.storage.run_dir import RunDir

pytestmark = pytest.mark.integration

SCRIPTED_EVALUATOR = """
from opd_trainer.sdk import AbstractRewardProcessor, Reward, RewardInput, RewardOutput, TaskStatus

# eval_score by validation: the teacher's baseline, the starting student, then a peak at step 2.
SCORES = {"teacher": 1.0, "student-before": 0.2, "step-1": 0.5, "step-2": 0.9, "student-after": 0.4}


class ScriptedEvaluator(AbstractRewardProcessor):
    async def process(self, reward_input: RewardInput) -> RewardOutput:
        rollout_id = reward_input.request_metadata.rollout_id
        score = next(v for k, v in SCORES.items() if f"-eval-{k}-r" in rollout_id)
        return RewardOutput(status=TaskStatus.SUCCESS, reward=Reward(reward_score=score))
"""


def _job(tiny_models: TinyModels, tmp_path: Path, **promotion: Any) -> Any:
    workspace = tmp_path / "workspace"
    (workspace / "functions").mkdir(parents=True)
    (workspace / "functions" / "__init__.py").write_text("")
    (workspace / "functions" / "scripted.py").write_text(SCRIPTED_EVALUATOR)
    validation = tmp_path / "validation.jsonl"
    write_jsonl(validation, read_jsonl(tiny_models.data_dir / "validation.jsonl")[:4])
    engine = {"kv_cache_memory_bytes": TINY_KV_CACHE_BYTES, "dtype": "float32"}
    pool = {"capacity": 1, "min_capacity": 1, "max_capacity": 1, "cpu": 0.5, "memory_size": 1024}
    return parse_job_spec(
        {
            "job_name": "promotion",
            "model": str(tiny_models.student),
            "teacher_model": str(tiny_models.teacher),
            "training_datasets": [str(tiny_models.data_dir / "train.jsonl")],
            "validation_datasets": [str(validation)],
            "functions": [
                {
                    "name": "scripted",
                    "type": "evaluator",
                    "fcmodel": {
                        "zipdir": str(workspace),
                        "classpath": "functions.scripted.ScriptedEvaluator",
                    },
                    "runtime": pool,
                    "timeout": 60,
                }
            ],
            "hyper_parameters": {
                "max_steps": 3,
                "eval_steps": 1,
                "save_steps": 100,
                "keep_last_n": 1,
                "batch_size": 2,
                "n_rollouts": 2,
                "ppo_mini_batch_size": 4,
                "max_tokens": 16,
                "max_length": 1024,
                "learning_rate": 1e-5,
            },
            "promotion": promotion,
            "resources": {"student": engine, "teacher": engine, "learner_gpus": 0},
            "report_to": [],
        }
    )


def _run(spec: Any, run_dir: Path) -> RunDir:
    driver = ray.remote(JobDriver).options(num_cpus=0).remote(spec, str(run_dir))
    try:
        ray.get(driver.run.remote())
    finally:
        ray.kill(driver)
    return RunDir(run_dir)


def test_the_peak_is_promoted_and_kept_and_an_unmet_gate_leaves_no_model(
    ray_session: None, tiny_models: TinyModels, tmp_path: Path
) -> None:
    run = _run(_job(tiny_models, tmp_path / "best"), tmp_path / "best" / "run")
    evals = {r["step"]: r["eval_score"] for r in run.records() if r["kind"] == "eval"}
    assert evals == {0: 0.2, 1: 0.5, 2: 0.9, 3: 0.4}
    promoted = run.promoted()
    assert promoted is not None and promoted["final"] and promoted["checkpoint"] == "step-000002"
    assert promoted["metric"] == "eval_score" and promoted["value"] == 0.9 and promoted["start"] == 0.2
    assert run.fine_tuned_model_id() == "step-000002"
    # Steps 1 and 2 were checkpointed for being the best so far (save_steps is 100), step 3 at the end;
    # keep_last_n=1 then kept the latest and the best, and removed step 1.
    assert [c["id"] for c in run.checkpoints()] == ["step-000002", "step-000003"]
    saved = [e["data"]["step"] for e in run.events() if e["type"] == "checkpoint" and "step" in e["data"]]
    assert saved == [1, 2, 3]
    assert any(e["type"] == "promotion" and "step-000002" in e["message"] for e in run.events())

    gated = _run(_job(tiny_models, tmp_path / "gated", threshold=0.95), tmp_path / "gated" / "run")
    promoted = gated.promoted()
    assert promoted is not None and promoted["final"] and promoted["checkpoint"] is None
    assert "threshold" in promoted["reason"] and "step 2" in promoted["reason"]
    assert gated.fine_tuned_model_id() is None
    events = gated.events()
    assert events[-1]["type"] == "status" and events[-1]["message"] == "succeeded"
    assert any(e["type"] == "warning" and e["message"].startswith("no fine_tuned_model") for e in events)
    assert [c["id"] for c in gated.checkpoints()] == ["step-000003"]  # only the final one: nothing promoted
