"""AgentScope-style workflow and judge functions submitted over HTTP: the client zips and uploads the
workspace and the task records, the real server runs the job on real Ray, vLLM and DeepSpeed; the judge
asks the job's teacher for a second opinion through `auxiliary_models`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from apiserver import Server, cancel_unfinished, create_key

from opd_trainer.client import OPDClient, StreamEnd
from opd_trainer.jsonl import read_jsonl, write_jsonl

if TYPE_CHECKING:
    from opd_trainer.demo.tiny_models import TinyModels

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ENGINE = {"kv_cache_memory_bytes": 134217728, "dtype": "float32"}

# AgentScope's tuner signatures; only the import line differs from a seed-002 workflow.
AGENT = """
import json
from pathlib import Path

from opd_trainer.tuner import JudgeOutput, WorkflowOutput

SETUP = json.loads((Path(__file__).parent / "setup.json").read_text())


def _messages(task):
    return [{"role": "system", "content": SETUP["system"]}, {"role": "user", "content": task["question"]}]


async def workflow(task, model, auxiliary_models=None):
    return WorkflowOutput(response=await model(_messages(task), tools=SETUP["tools"]))


async def judge(task, response, auxiliary_models=None):
    made = [call["function"]["name"] for call in response.get("tool_calls") or []]
    wanted = [call["name"] for call in task["answer"].get("tool_calls") or []]
    opinion = await auxiliary_models["second_opinion"](_messages(task), tools=SETUP["tools"])
    agrees = [call["function"]["name"] for call in opinion.get("tool_calls") or []] == made
    return JudgeOutput(reward=float(made == wanted), metrics={"teacher_agrees": float(agrees)})
"""


def _task(record: dict) -> dict:
    question = next(m["content"] for m in record["messages"] if m["role"] == "user")
    return {"question": question, "answer": json.loads(record["rollout_extra"]["solution"])}


def test_workflow_and_judge_functions_train_through_the_http_api(
    trained_models: TinyModels, tmp_path: Path, training_server: Server
) -> None:
    records = read_jsonl(trained_models.data_dir / "train.jsonl")
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    setup = {"system": records[0]["messages"][0]["content"], "tools": records[0]["tools"]}
    (workspace / "setup.json").write_text(json.dumps(setup))
    (workspace / "tool_agent.py").write_text(AGENT)
    write_jsonl(tmp_path / "tasks.jsonl", [_task(r) for r in records[:8]])

    server = training_server  # the session's (tests/conftest.py): scheduler on, one job at a time
    client = OPDClient(server.url, create_key(server.url, "workflows"))
    job = None
    try:
        job = client.submit(
            {
                "job_name": "api-workflow",
                "model": str(trained_models.student),
                "teacher_model": str(trained_models.teacher),
                "training_datasets": [str(tmp_path / "tasks.jsonl")],
                "functions": [
                    {
                        "name": "workflow",
                        "type": "rollout",
                        "fcmodel": {"zipdir": str(workspace), "classpath": "tool_agent.py:workflow"},
                    },
                    {
                        "name": "judge",
                        "type": "reward",
                        "fcmodel": {"zipdir": str(workspace), "classpath": "tool_agent.py:judge"},
                    },
                ],
                "auxiliary_models": {"second_opinion": "teacher"},
                "hyper_parameters": {
                    "max_steps": 2,
                    "batch_size": 4,
                    "n_rollouts": 2,
                    "ppo_mini_batch_size": 8,
                    "max_tokens": 48,
                    "save_steps": 100,
                },
                "resources": {"student": ENGINE, "teacher": ENGINE, "learner_gpus": 0},
            }
        )
        *_, end = client.stream_events(job.id)
        assert isinstance(end, StreamEnd) and end.job is not None
        assert end.job.status == "succeeded", server.log()[-4000:]
        # What the server stored: the uploaded workspace and task records, the function classpaths.
        spec = end.job.spec
        assert spec["auxiliary_models"] == {"second_opinion": "teacher"}
        assert spec["functions"][0]["fcmodel"]["classpath"] == "tool_agent.py:workflow"
        assert spec["training_datasets"][0].startswith("file-")
        steps = [r for r in client.metrics(job.id).data if r["kind"] == "train"]
        assert [r["step"] for r in steps] == [1, 2]
        for step in steps:
            assert step["failed_rollouts"] == 0 and step["trained_tokens"] > 0
            assert step["llm_calls_per_rollout"] == 1  # the judge's teacher call is not a training segment
            assert 0.0 <= step["reward/judge"] <= 1.0 and "reward/judge/teacher_agrees" in step
        trajectories = client.trajectories(job.id, limit=8)
        assert trajectories and all(t["auxiliary_calls"] == 1 for t in trajectories)
        assert all(t["messages"][-1]["role"] == "assistant" for t in trajectories)
    finally:
        cancel_unfinished(client, job.id if job is not None else None)
