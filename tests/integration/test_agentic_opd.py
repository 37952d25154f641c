"""Agentic OPD end to end: the user's agent and rewards in worker pools, through the gateway, on real Ray."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
from driver_runs import run_driver

from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.demo.tiny_models.serving import TINY_KV_CACHE_BYTES
from opd_trainer.jobspec.job_spec import JobSpec, parse_job_spec
from opd_trainer.storage.run_dir import RunDir

pytestmark = pytest.mark.integration

EXAMPLE_WORKSPACE = Path(__file__).resolve().parents[2] / "examples" / "tool_routing_agentic" / "workspace"

FLAKY_ROLLOUT = '''
import asyncio
import hashlib
import os

from functions.rollout import ToolRoutingRollout


class FlakyRollout(ToolRoutingRollout):
    """Raises, hangs past the timeout (in step 1) or dies on its first attempt, by rollout id; else the
    real agent."""

    async def process(self, rollout_input):
        meta = rollout_input.request_metadata
        bucket = int(hashlib.sha256(meta.rollout_id.encode()).hexdigest(), 16) % 8
        if bucket == 0:
            raise RuntimeError("user bug: KeyError in tool parsing")
        # Step 1 only (ids are local-s<step>-r<index>; its 16 hold 3 hangs, 1 raise, 1 death): a step
        # with a hang lasts the whole timeout, so hanging in both steps cost 45 s more.
        if bucket == 1 and "-s1-" in meta.rollout_id:
            await asyncio.sleep(120)
        if bucket == 2 and meta.attempt_id == 0:
            os._exit(3)
        return await super().process(rollout_input)
'''


def _spec(tiny_models: TinyModels, workspace: Path, rollout_classpath: str, **hyper: Any) -> JobSpec:
    engine = {"kv_cache_memory_bytes": TINY_KV_CACHE_BYTES, "dtype": "float32"}
    runtime = {
        "cpu": 0.25,
        "memory_size": 1024,
        "concurrency": 16,
        "capacity": 1,
        "min_capacity": 1,
        "max_capacity": 2,
    }
    return parse_job_spec(
        {
            "job_name": "it-agentic",
            "model": str(tiny_models.student),
            "teacher_model": str(tiny_models.teacher),
            "training_datasets": [str(tiny_models.data_dir / "train.jsonl")],
            "functions": [
                {
                    "name": "agent",
                    "type": "rollout",
                    # Generous for a loaded 2-core machine (16 rollouts at once); the hanging processor
                    # below sleeps 120 s, so it still times out.
                    "timeout": 45,
                    "fcmodel": {"zipdir": str(workspace), "classpath": rollout_classpath},
                    "runtime": runtime,
                },
                {
                    "name": "decision",
                    "type": "reward",
                    "weight": 0.5,
                    "fcmodel": {"zipdir": str(workspace), "classpath": "functions.reward.DecisionReward"},
                    "runtime": runtime,
                },
                {
                    "name": "arguments",
                    "type": "reward",
                    "weight": 0.5,
                    "reward_metric_weight": {"destructive_penalty": 1.0},
                    "fcmodel": {"zipdir": str(workspace), "classpath": "functions/reward.py:ArgumentReward"},
                    "runtime": runtime,
                },
            ],
            "hyper_parameters": {
                "max_steps": 2,
                "learning_rate": 5e-4,
                "batch_size": 8,
                "n_rollouts": 2,
                "ppo_mini_batch_size": 16,
                "max_length": 1024,
                "max_tokens": 48,
                "reward_coef": 1.0,
                "save_steps": 100,
                "seed": 1,
                **hyper,
            },
            "resources": {"student": engine, "teacher": engine, "learner_gpus": 0},
        }
    )


def _run(spec: JobSpec, run_dir: Path) -> None:
    run_driver(spec, run_dir)


def test_agentic_job_with_two_rewards_reports_the_weighted_reward(
    ray_session: None, tiny_models: TinyModels, tmp_path: Path
) -> None:
    """Two weighted rewards, and the turn-level preference term beside them (the agent's turns where a
    prompt's better and worse rollouts answered the same context differently, as DPO pairs)."""
    spec = _spec(
        tiny_models, EXAMPLE_WORKSPACE, "functions.rollout.ToolRoutingRollout", turn_preference_coef=0.5
    )
    _run(spec, tmp_path / "run")
    records = [r for r in RunDir(tmp_path / "run").records() if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2]
    # 16 prompts of 2 rollouts at temperature 1 whose rewards differ in some: pairs were mined, and a
    # mini-batch of 16 rollouts (8 prompts) keeps each whole. With 2 rollouts a prompt gives at most one
    # pair and prompts differ, so none conflicts or repeats. The learner trained them: a finite DPO loss.
    assert sum(r["preference/pairs"] for r in records) > 0, records
    for record in records:
        assert record["preference/split_pairs"] == record["preference/conflicting"] == 0
        if record["preference/pairs"] > 0:
            assert math.isfinite(record["preference/loss"]) and 0 <= record["preference/accuracy"] <= 1
    for record in records:
        assert {"reward_mean", "reward_std", "reward/decision", "reward/arguments"} <= set(record)
        assert "reward/arguments/destructive_penalty" in record and "rollout/turns" in record
        assert record["failed_rollouts"] == 0 and record["llm_calls_per_rollout"] >= 1
    trajectories = [
        json.loads(line) for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()
    ]
    assert trajectories
    for trajectory in trajectories:
        parts = trajectory["component_rewards"]
        penalty = trajectory["reward_metrics"]["arguments/destructive_penalty"]
        expected = 0.5 * parts["decision"] + 0.5 * (parts["arguments"] + 1.0 * penalty)
        assert trajectory["reward"] == pytest.approx(expected)
        assert any(span["name"] == "llm.call" for span in trajectory["spans"])
        assert any(span["attributes"].get("opd.kind") == "reward" for span in trajectory["spans"])
    step_one = [t for t in trajectories if t["step"] == 1]
    assert len(step_one) == records[0]["rollouts"] == 16  # every rollout of the step is kept (16 per step)
    assert records[0]["reward_mean"] == pytest.approx(sum(t["reward"] for t in step_one) / 16, abs=1e-6)


def test_raising_hanging_and_dying_processors_are_contained(
    ray_session: None, tiny_models: TinyModels, tmp_path: Path
) -> None:
    workspace = tmp_path / "workspace"
    shutil.copytree(EXAMPLE_WORKSPACE, workspace)
    (workspace / "functions" / "flaky.py").write_text(FLAKY_ROLLOUT)
    spec = _spec(tiny_models, workspace, "functions.flaky.FlakyRollout", max_failed_ratio=0.6)
    _run(spec, tmp_path / "run")
    records = [r for r in RunDir(tmp_path / "run").records() if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2]
    assert sum(r["failed_rollouts"] for r in records) > 0
    trajectories = [
        json.loads(line) for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()
    ]
    errors = " ".join(t["error"] for t in trajectories)
    assert "user bug" in errors and "timed out after 45s" in errors
    assert any(t["attempt_id"] == 1 and not t["failed"] for t in trajectories), (
        "a killed worker's call was retried"
    )
