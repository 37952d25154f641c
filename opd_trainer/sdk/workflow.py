"""Workflow and judge *functions* (AgentScope tuner's signatures) as rollout and reward processors.

A component's classpath may name an `async def` instead of a processor class:

    async def workflow(task: dict, model, auxiliary_models: dict | None = None) -> WorkflowOutput
    async def judge(task: dict, response, auxiliary_models: dict | None = None) -> JudgeOutput

`type: rollout` takes a workflow, `type: reward` / `evaluator` a judge. The loader wraps the function in a
processor class (`workflow_processor`, `judge_processor`), so pools, retries, timeouts and tracing treat
it as any other processor.

- `task`: a task record as the dataset wrote it (any JSON object without `messages`, e.g.
  `{"question": ..., "answer": ...}`); for a chat sample, `{"messages", "tools", "ground_truth"}` plus its
  `rollout_extra`.
- `model`: a chat model bound to the student through the job's recording gateway (this rollout's key,
  seed, temperature and max_tokens): AgentScope's `OpenAIChatModel` (non-streaming) when the worker can
  import AgentScope 1.x, the version with the tuner (`agentscope>=1,<2` in the workspace's
  requirements.txt), so `ReActAgent(model=model, ...)` runs unchanged; otherwise `GatewayChatModel`,
  whose `await model(messages, tools=None, **kwargs)` returns the assistant message as an OpenAI dict.
- `auxiliary_models`: the models the job serves to its processors besides the student (job field
  `auxiliary_models`, e.g. `{judge: teacher}`), by name, each a chat model of the same kind as `model`
  bound to its own gateway (greedy, never trained on); `{}` when the job names none.
- The workflow's `reward` (if set) is the rollout's own reward (used when the job has no reward
  component), its `metrics` are logged as rollout metrics, and its `response` reaches the judge: an
  AgentScope `Msg` travels as its dict and is rebuilt as a `Msg` where the judge's worker has
  `agentscope`; any other value travels as JSON (its `str()` when it is not JSON-able).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, Field

from opd_trainer.jobspec.dataset import (
    TASK_KEY,  # a task record's key, also that of the task handed to rewards
)
from opd_trainer.sdk.types import (
    AbstractRewardProcessor,
    AbstractRolloutProcessor,
    AgentOutput,
    ModelResource,
    Reward,
    RewardInput,
    RewardOutput,
    RolloutInput,
    RolloutOutput,
    shared_http_client,
)

RESPONSE_KEY = "workflow_response"
"""`AgentOutput.rollout_extra` key of the workflow's response, as it travels to the judge."""
_MSG_MARK = "__agentscope_msg__"


class WorkflowOutput(BaseModel):
    """What a workflow function returns (AgentScope's fields)."""

    reward: float | None = Field(default=None, description="A reward the workflow computed itself.")
    response: Any | None = Field(default=None, description="The workflow's answer, handed to the judge.")
    metrics: dict[str, float] | None = Field(default=None, description="Metrics to log, by name.")


class JudgeOutput(BaseModel):
    """What a judge function returns (AgentScope's fields)."""

    reward: float = Field(description="The reward.")
    metrics: dict[str, float] | None = Field(default=None, description="Named sub-scores, logged.")


class GatewayChatModel:
    """An OpenAI-compatible chat model bound to one rollout's gateway key (the fallback `model`)."""

    def __init__(self, resource: ModelResource, sampling: dict[str, Any]) -> None:
        self.model_name = resource.model_name
        self._resource = resource
        self.generate_kwargs = dict(sampling)

    @property
    def client(self) -> Any:
        """The rollout's `AsyncOpenAI` (traced, shared connection pool)."""
        return self._resource.openai_client()

    async def __call__(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        body = {**self.generate_kwargs, **kwargs}
        if tools:
            body["tools"] = tools
        reply = await self.client.chat.completions.create(model=self.model_name, messages=messages, **body)
        return reply.choices[0].message.model_dump(exclude_none=True)  # type: ignore[no-any-return]


def chat_model(resource: ModelResource, sampling: dict[str, Any]) -> Any:
    """AgentScope's `OpenAIChatModel` on the gateway where AgentScope 1.x (the tuner's API) imports, else
    `GatewayChatModel` (AgentScope 2.x rebuilt its model classes and has no tuner: not bound)."""
    generate = {k: v for k, v in sampling.items() if k in {"temperature", "max_tokens", "seed"}}
    try:
        # Lazy: optional dependency (agentscope, the workspace's), loaded by a workflow that uses it.
        from agentscope.model import OpenAIChatModel
    except ImportError:
        return GatewayChatModel(resource, generate)
    parameters = inspect.signature(OpenAIChatModel).parameters
    if "model_name" not in parameters:
        return GatewayChatModel(resource, generate)
    # Retries off: a retried call would be recorded (and trained on) twice. The loop's shared connection
    # pool: a pool of its own costs ~20 ms of CPU per rollout (more than a tiny model's completion).
    client = {"base_url": resource.base_url, "max_retries": 0, "http_client": shared_http_client()}
    named = "client_kwargs" if "client_kwargs" in parameters else "client_args"  # renamed within 1.x
    return OpenAIChatModel(
        model_name=resource.model_name,
        api_key=resource.api_key.get_secret_value(),
        stream=False,
        generate_kwargs=generate,
        **{named: client},
    )


def auxiliary_chat_models(resources: dict[str, ModelResource]) -> dict[str, Any]:
    """The `auxiliary_models` a workflow or judge receives: a chat model per served model (their gateways
    set temperature and cap max_tokens)."""
    return {name: chat_model(resource, {}) for name, resource in resources.items()}


def task_of(rollout_input: RolloutInput) -> dict[str, Any]:
    """The `task` a workflow receives; see the module docstring."""
    extra = rollout_input.rollout_extra
    if isinstance(extra.get(TASK_KEY), dict):
        return dict(extra[TASK_KEY])
    task = {"messages": rollout_input.messages, "tools": rollout_input.tools}
    return {**task, "ground_truth": rollout_input.ground_truth, **extra}


def _text_of(response: Any) -> str:
    if response is None:
        return ""
    if hasattr(response, "get_text_content"):
        return str(response.get_text_content() or "")
    return response if isinstance(response, str) else json.dumps(_portable(response), ensure_ascii=False)


def _portable(response: Any) -> Any:
    """The response as JSON: an AgentScope `Msg` as its dict (marked), JSON values as they are."""
    if hasattr(response, "to_dict") and type(response).__name__ == "Msg":
        return {_MSG_MARK: response.to_dict()}
    try:
        json.dumps(response)
    except (TypeError, ValueError):
        return str(response)
    return response


def restore_response(value: Any) -> Any:
    """A response back from its JSON form: a `Msg` again where `agentscope` imports."""
    if isinstance(value, dict) and _MSG_MARK in value:
        try:
            # Lazy: optional dependency (agentscope, the workspace's), loaded by a workflow that uses it.
            from agentscope.message import Msg
        except ImportError:
            return value[_MSG_MARK]
        return Msg.from_dict(value[_MSG_MARK])
    return value


Workflow = Callable[..., Awaitable[Any]]


def workflow_processor(function: Workflow) -> type[AbstractRolloutProcessor]:
    """A rollout processor class running `function` as an AgentScope workflow."""

    class WorkflowProcessor(AbstractRolloutProcessor):
        async def process(self, rollout_input: RolloutInput) -> RolloutOutput:
            task = task_of(rollout_input)
            model = chat_model(rollout_input.model_resource, rollout_input.sampling_params)
            output = await function(task, model, auxiliary_chat_models(rollout_input.auxiliary_models))
            if not isinstance(output, WorkflowOutput):
                output = WorkflowOutput.model_validate(output, from_attributes=True)
            messages = [*rollout_input.messages, {"role": "assistant", "content": _text_of(output.response)}]
            return RolloutOutput(
                agent_output=AgentOutput(
                    messages=messages,
                    reward_score=output.reward,
                    rollout_metrics=dict(output.metrics or {}),
                    rollout_extra={TASK_KEY: task, RESPONSE_KEY: _portable(output.response)},
                )
            )

    WorkflowProcessor.__name__ = WorkflowProcessor.__qualname__ = f"Workflow[{function.__name__}]"
    return WorkflowProcessor


def judge_processor(function: Workflow) -> type[AbstractRewardProcessor]:
    """A reward processor class running `function` as an AgentScope judge."""

    class JudgeProcessor(AbstractRewardProcessor):
        async def process(self, reward_input: RewardInput) -> RewardOutput:
            extra = reward_input.agent_output.rollout_extra
            task = extra.get(TASK_KEY)
            if not isinstance(task, dict):  # a rollout that is not a workflow: the sample as a task
                task = {
                    "messages": reward_input.agent_output.messages,
                    "ground_truth": reward_input.ground_truth,
                }
            if RESPONSE_KEY in extra:
                response = restore_response(extra[RESPONSE_KEY])
            else:
                messages = reward_input.agent_output.messages
                response = messages[-1].get("content") if messages else None
            output = await function(task, response, auxiliary_chat_models(reward_input.auxiliary_models))
            if not isinstance(output, JudgeOutput):
                output = JudgeOutput.model_validate(output, from_attributes=True)
            return RewardOutput(
                reward=Reward(reward_score=output.reward, reward_metrics=dict(output.metrics or {}))
            )

    JudgeProcessor.__name__ = JudgeProcessor.__qualname__ = f"Judge[{function.__name__}]"
    return JudgeProcessor
