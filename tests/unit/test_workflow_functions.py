"""Workflow and judge functions (AgentScope tuner signatures) loaded by classpath and run as processors,
task records in datasets, `DatasetConfig.preview`. The model the workflow gets is exercised against the
real gateway in tests/integration/test_workflow_functions.py; here the workflow does not call it."""

from __future__ import annotations

import asyncio
import json
import sys
import types as module_types
from pathlib import Path
from typing import Any

import pytest

from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.dataset import ground_truth_of, load_samples
from opd_trainer.jobspec.preflight import check_task_records
from opd_trainer.sdk import ModelResource, RewardInput, RolloutInput
from opd_trainer.sdk import types as sdk_types
from opd_trainer.sdk.workflow import GatewayChatModel, chat_model
from opd_trainer.tuner import DatasetConfig
from opd_trainer.workers.classpath import ProcessorLoadError, instantiate_processor, load_processor_class

FUNCTIONS = """
from opd_trainer.tuner import JudgeOutput, WorkflowOutput


async def workflow(task, model, auxiliary_models=None):
    assert auxiliary_models == {} and model.model_name == "student"
    return WorkflowOutput(response={"answer": task["question"].split()[-1]}, metrics={"turns": 1.0})


async def judge(task, response, auxiliary_models=None):
    right = response["answer"] == task["answer"]
    return JudgeOutput(reward=1.0 if right else 0.0, metrics={"right": float(right)})


def not_async(task, model):
    return None


async def one_argument(task):
    return None
"""


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    folder = tmp_path / "ws"
    folder.mkdir()
    (folder / "math_agent.py").write_text(FUNCTIONS)
    return folder


def _resource() -> ModelResource:
    return ModelResource(model_name="student", base_url="http://127.0.0.1:9/v1", api_key="k")


def test_a_workflow_and_a_judge_run_as_processors(workspace: Path) -> None:
    workflow = instantiate_processor(load_processor_class(workspace, "math_agent.py:workflow", "rollout"))
    judge = instantiate_processor(load_processor_class(workspace, "math_agent.py:judge", "reward"))
    task = {"question": "what is 2 + 2 = 4", "answer": "4"}
    rollout = RolloutInput(
        messages=[],
        rollout_extra={"task": task},
        sampling_params={"temperature": 0.7},
        model_resource=_resource(),
    )
    output = asyncio.run(workflow.process(rollout))
    agent = output.agent_output
    assert agent is not None and agent.rollout_metrics == {"turns": 1.0}
    assert agent.messages == [{"role": "assistant", "content": json.dumps({"answer": "4"})}]
    assert agent.rollout_extra["task"] == task  # the judge gets the task as the workflow did
    scored = asyncio.run(judge.process(RewardInput(ground_truth="4", agent_output=agent)))
    assert scored.reward is not None and scored.reward.reward_score == 1.0
    assert scored.reward.reward_metrics == {"right": 1.0}


@pytest.mark.parametrize(
    ("name", "problem"), [("not_async", "a function, not a class"), ("one_argument", "cannot be called as")]
)
def test_functions_that_do_not_fit_the_signatures_are_refused_naming_the_field(
    workspace: Path, name: str, problem: str
) -> None:
    with pytest.raises(ProcessorLoadError, match=problem) as raised:
        load_processor_class(workspace, f"math_agent.py:{name}", "rollout", component="agent")
    assert raised.value.field == "functions.agent.fcmodel.classpath"


def test_the_model_is_the_gateway_bound_fallback_without_agentscope() -> None:
    import importlib.util

    assert importlib.util.find_spec("agentscope") is None  # the test venv has no agentscope
    model = chat_model(_resource(), {"temperature": 0.5, "max_tokens": 8, "seed": 3, "top_p": 1.0})
    assert isinstance(model, GatewayChatModel)
    assert model.generate_kwargs == {"temperature": 0.5, "max_tokens": 8, "seed": 3}


def test_agentscope_chat_models_share_the_loops_connection_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """AgentScope 1.x's `OpenAIChatModel` (a stand-in with its signature here; the real package runs in
    tests/integration/test_workflow_functions.py) gets the event loop's shared HTTP client, no retries
    and the rollout's key: one pool per loop, not a ~20 ms one per rollout."""
    built: list[dict[str, Any]] = []

    class OpenAIChatModel:
        def __init__(
            self,
            model_name: str,
            api_key: str | None = None,
            stream: bool = True,
            generate_kwargs: dict[str, Any] | None = None,
            client_kwargs: dict[str, Any] | None = None,
        ) -> None:
            built.append(dict(model_name=model_name, api_key=api_key, stream=stream, **(client_kwargs or {})))

    fake = module_types.ModuleType("agentscope.model")
    fake.OpenAIChatModel = OpenAIChatModel  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "agentscope", module_types.ModuleType("agentscope"))
    monkeypatch.setitem(sys.modules, "agentscope.model", fake)
    monkeypatch.setattr(sdk_types, "_http_client", object)  # a new object per call: each pool is told apart

    async def build() -> Any:
        chat_model(_resource(), {"seed": 1})
        chat_model(_resource(), {"seed": 2})
        return sdk_types.shared_http_client()

    first_loop_pool = asyncio.run(build())
    second_loop_pool = asyncio.run(build())
    assert [b["http_client"] for b in built] == [first_loop_pool] * 2 + [second_loop_pool] * 2
    assert first_loop_pool is not second_loop_pool  # a pool never crosses event loops
    assert all(b["max_retries"] == 0 and b["stream"] is False for b in built)
    assert {b["api_key"] for b in built} == {_resource().api_key.get_secret_value()}


def test_auxiliary_models_reach_the_workflow_and_the_judge_as_chat_models(tmp_path: Path) -> None:
    (tmp_path / "aux_agent.py").write_text(AUXILIARY)
    workflow = instantiate_processor(load_processor_class(tmp_path, "aux_agent.py:workflow", "rollout"))
    judge = instantiate_processor(load_processor_class(tmp_path, "aux_agent.py:judge", "reward"))
    teacher = ModelResource(model_name="teacher", base_url="http://127.0.0.1:9/v1", api_key="t")
    rollout = RolloutInput(
        messages=[],
        rollout_extra={"task": {"question": "q"}},
        model_resource=_resource(),
        auxiliary_models={"judge": teacher},
    )
    agent = asyncio.run(workflow.process(rollout)).agent_output
    assert agent is not None and agent.rollout_metrics == {"auxiliary": 1.0}
    scored = asyncio.run(judge.process(RewardInput(agent_output=agent, auxiliary_models={"judge": teacher})))
    assert scored.reward is not None and scored.reward.reward_score == 1.0
    # A job that names none hands an empty dict.
    assert asyncio.run(judge.process(RewardInput(agent_output=agent))).reward.reward_score == 0.0


AUXILIARY = """
from opd_trainer.tuner import JudgeOutput, WorkflowOutput


async def workflow(task, model, auxiliary_models=None):
    judge = auxiliary_models["judge"]
    assert judge.model_name == "teacher" and not judge.generate_kwargs  # its gateway sets sampling
    return WorkflowOutput(response="r", metrics={"auxiliary": float(len(auxiliary_models))})


async def judge(task, response, auxiliary_models=None):
    return JudgeOutput(reward=float(list(auxiliary_models) == ["judge"]))
"""


def test_task_records_load_whole_and_need_a_rollout(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "What is 2 + 2?", "answer": "4"}\n{"question": "4 + 4?", "answer": "8"}\n')
    samples = load_samples([str(data)], "training_datasets")
    assert [s.messages for s in samples] == [[], []]
    assert samples[0].rollout_extra == {"task": {"question": "What is 2 + 2?", "answer": "4"}}
    assert ground_truth_of(samples[1]) == "8"
    with pytest.raises(ConfigError) as raised:
        check_task_records(samples, "training_datasets", has_rollout=False)
    assert raised.value.field == "training_datasets" and "rollout component" in raised.value.message
    check_task_records(samples, "training_datasets", has_rollout=True)
    assert DatasetConfig(path=tmp_path, split="train").preview(n=1) == [
        {"question": "What is 2 + 2?", "answer": "4"}
    ]
    (tmp_path / "bad.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="line 1: a record must not be empty"):
        DatasetConfig(path=tmp_path / "bad.jsonl").preview()


def test_tune_reads_a_folder_by_split_train_for_training_test_for_evaluation(tmp_path: Path) -> None:
    from opd_trainer.tuner import dataset_file

    assert dataset_file(tmp_path, "train") == str(tmp_path / "train.jsonl")
    assert dataset_file(tmp_path, "test") == str(tmp_path / "test.jsonl")
    assert dataset_file(DatasetConfig(tmp_path, "dev"), "test") == str(tmp_path / "dev.jsonl")
    single = tmp_path / "tasks.jsonl"
    single.write_text("{}\n")
    assert dataset_file(single, "test") == str(single)
