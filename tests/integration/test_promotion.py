"""Promotion, metering and budgets in real jobs: the best validation becomes the model, checkpointed
between save_steps and kept by retention; a gate no validation meets leaves the job without a model;
the usage the job reports adds up from its records and every role; a teacher-token budget stops the
job cleanly at the step that reaches it.

The evaluator is scripted by validation (it reads the label in the rollout id: `eval-step-2`, ...), so
the job's curve rises to a peak at step 2 and falls after it whatever the tiny models learn; everything
else is real (engines, learner, pools, checkpoints)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from driver_runs import run_driver

from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.demo.tiny_models.serving import TINY_KV_CACHE_BYTES
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


def _job(
    tiny_models: TinyModels, tmp_path: Path, budget: dict[str, Any] | None = None, **promotion: Any
) -> Any:
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
            "budget": budget or {},
            "resources": {"student": engine, "teacher": engine, "learner_gpus": 0},
            "report_to": [],
        }
    )


def _run(spec: Any, run_dir: Path) -> RunDir:
    run_driver(spec, run_dir)
    return RunDir(run_dir)


def test_the_peak_is_promoted_and_kept_and_an_unmet_gate_leaves_no_model(
    ray_session: None, tiny_models: TinyModels, tmp_path: Path
) -> None:
    run = _run(_job(tiny_models, tmp_path / "best"), tmp_path / "best" / "run")
    evals = {r["step"]: r["eval_score"] for r in run.records() if r["kind"] == "eval"}
    assert evals == {0: 0.2, 1: 0.5, 2: 0.9, 3: 0.4}
    promoted = run.promoted()
    assert promoted is not None and promoted.final and promoted.checkpoint == "step-000002"
    assert promoted.metric == "eval_score" and promoted.value == 0.9 and promoted.start == 0.2
    assert run.fine_tuned_model_id() == "step-000002"
    # Steps 1 and 2 were checkpointed for being the best so far (save_steps is 100), step 3 at the end;
    # keep_last_n=1 then kept the latest and the best, and removed step 1.
    assert [c["id"] for c in run.checkpoints()] == ["step-000002", "step-000003"]
    saved = [e.data["step"] for e in run.events() if e.type == "checkpoint" and "step" in e.data]
    assert saved == [1, 2, 3]
    assert any(e.type == "promotion" and "step-000002" in e.message for e in run.events())

    # Metering: the usage the job ends with is what its records add up to, and every role used CPU.
    usage = run.usage()
    records = run.records()
    for key in ("teacher_tokens", "student_generated_tokens", "learner_tokens_trained", "processor_calls"):
        assert usage[key] > 0 and sum(r[f"usage/{key}"] for r in records) == pytest.approx(usage[key])
    trained = sum(r["trained_tokens"] for r in records if r["kind"] == "train")
    assert usage["learner_tokens_trained"] == trained
    roles = ("student_engines", "teacher_engines", "learner", "processors", "driver")
    assert all(usage[f"cpu_s/{role}"] > 0 for role in roles), usage
    # The gateways ran in the teacher engine's process: their CPU is the teacher's, counted once.
    assert usage["cpu_s/gateways"] == 0.0, usage
    assert usage["gpu_s"] == 0.0 and usage["wall_s"] > 0
    assert any(e.type == "usage" for e in run.events())

    # The same job, gated by a threshold no validation meets and with a teacher-token budget the first
    # job's second step crossed: it stops at the step whose record reaches the budget.
    used = 0.0
    for record in records:
        used += record["usage/teacher_tokens"]
        if record["kind"] == "train" and record["step"] == 1:
            break
    budget = {"max_teacher_tokens": int(used) + 1}
    gated_spec = _job(tiny_models, tmp_path / "gated", budget=budget, threshold=0.95)
    gated = _run(gated_spec, tmp_path / "gated" / "run")
    steps = [r["step"] for r in gated.records() if r["kind"] == "train"]
    cumulative, stop_step = 0.0, None
    for record in gated.records():
        cumulative += record["usage/teacher_tokens"]
        if record["kind"] == "train" and cumulative >= budget["max_teacher_tokens"]:
            stop_step = record["step"]
            break
    assert stop_step is not None and steps[-1] == stop_step == 2  # one step past the first job's step 1
    events = gated.events()
    [reached] = [e for e in events if e.type == "budget"]
    assert reached.message.startswith("budget.max_teacher_tokens reached") and reached.data["step"] == 2
    promoted = gated.promoted()
    assert promoted is not None and promoted.final and promoted.checkpoint is None
    assert "threshold" in promoted.reason
    assert gated.fine_tuned_model_id() is None
    assert events[-1].type == "status" and events[-1].message == "succeeded"
    assert any(e.type == "warning" and e.message.startswith("no fine_tuned_model") for e in events)
    assert [c["id"] for c in gated.checkpoints()] == ["step-000002"]  # the stop's checkpoint only
