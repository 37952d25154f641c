"""The lookup example end to end, one step: its agent plays lookup episodes against the backend through
the gateway in a real worker pool, and its reward judges them in another. Run on the demo's tiny teacher
as the student (trained on another prompt, it rarely follows the chain, so its own wrong turns meet
the backend's errors); the episodes' own models are `--variant lookup` (not built here: too slow)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from driver_runs import run_driver

from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.demo.tool_routing.lookup import make_episodes, run_tool, score_episode
from opd_trainer.jobspec.job_spec import load_job_spec
from opd_trainer.jsonl import write_jsonl
from opd_trainer.storage.run_dir import RunDir

pytestmark = pytest.mark.integration

EXAMPLE_JOB = Path(__file__).resolve().parents[2] / "examples" / "lookup_agentic" / "job.yaml"


def test_lookup_episodes_run_against_the_backend_and_are_judged(
    ray_session: None, tiny_models: TinyModels, tmp_path: Path
) -> None:
    train, validation = tmp_path / "train.jsonl", tmp_path / "validation.jsonl"
    episodes = {"train": make_episodes("train", 4), "validation": make_episodes("validation", 4)}
    write_jsonl(train, episodes["train"])
    write_jsonl(validation, episodes["validation"])
    spec = load_job_spec(EXAMPLE_JOB)
    data = spec.model_dump()
    data.update(
        model=str(tiny_models.teacher),
        teacher_model=str(tiny_models.teacher),
        training_datasets=[str(train)],
        validation_datasets=[str(validation)],
    )
    data["hyper_parameters"].update(
        max_steps=1, eval_steps=1, batch_size=4, n_rollouts=2, ppo_mini_batch_size=8
    )
    run_dir = tmp_path / "run"
    run_driver(type(spec).model_validate(data), run_dir)

    records = RunDir(run_dir).records()
    (step,) = [r for r in records if r["kind"] == "train"]
    assert step["failed_rollouts"] == 0 and step["rollouts"] == 8
    assert {"reward_mean", "rollout/tool_errors", "rollout/turns"} <= set(step)
    (final,) = [r for r in records if r["kind"] == "eval" and r["step"] == 1]
    for name in ("agent/task_success", "agent/turn_success", "agent/tool_call_accuracy"):
        assert 0.0 <= final[name] <= 1.0, (name, final[name])
    assert "reward/episode/calls_correct" in final

    trajectories = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    by_id = {r["rollout_extra"]["sample_id"]: r for split in episodes.values() for r in split}
    assert len(trajectories) >= 8
    for trajectory in trajectories:
        episode = by_id[trajectory["sample_id"]]
        extra, messages = episode["rollout_extra"], trajectory["messages"]
        # The reward that came back from the reward pool is the episode judge's verdict on these messages.
        assert (
            trajectory["reward"]
            == score_episode(messages, len(episode["messages"]), extra["solution"]).reward
        )
        # Every tool message is the backend's answer to the call before it, over this episode's item.
        for message, reply in itertools.pairwise(messages):
            if len(message.get("tool_calls") or []) == 1 and reply["role"] == "tool":
                function = message["tool_calls"][0]["function"]
                assert reply["content"] == run_tool(function["name"], _arguments(function), extra["items"])


def _arguments(function: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments as the agent passed them to the backend (an empty dict when not a JSON object)."""
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return {}
    return arguments if isinstance(arguments, dict) else {}
