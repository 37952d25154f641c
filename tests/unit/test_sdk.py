"""The processor SDK: Bailian field names, pickling, `call_processor` and `is_rollout_failure`."""

from __future__ import annotations

import asyncio
import pickle
import threading

import openai
import pytest
from pydantic import SecretStr, ValidationError

from opd_trainer.sdk import (
    AbstractRewardProcessor,
    AbstractRolloutProcessor,
    AgentOutput,
    ModelResource,
    RequestMetadata,
    Reward,
    RewardInput,
    RewardOutput,
    RolloutInput,
    RolloutOutput,
    TaskStatus,
    call_processor,
    is_rollout_failure,
    observe_processor,
    trace_client,
)

SECRET = "sk-very-secret-token"


def _metadata() -> RequestMetadata:
    return RequestMetadata(job_id="job-1", sample_id="s-1", rollout_id="r-1", attempt_id=2)


def _rollout_input() -> RolloutInput:
    return RolloutInput(
        messages=[{"role": "user", "content": "hi"}],
        tools=[{"type": "function", "function": {"name": "search"}}],
        ground_truth="42",
        rollout_extra={"task": "t"},
        sampling_params={"temperature": 0.7},
        model_resource=ModelResource(model_name="student", base_url="http://gw/v1", api_key=SECRET),
        request_metadata=_metadata(),
    )


def _agent_output(content: object = "hello") -> AgentOutput:
    return AgentOutput(
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}],
        rollout_extra={"k": 1},
        rollout_metrics={"turns": 1.0},
        reward_score=0.5,
    )


def test_field_names_follow_bailian() -> None:
    expected = {
        ModelResource: {"model_name", "base_url", "api_key"},
        RequestMetadata: {"job_id", "sample_id", "rollout_id", "attempt_id"},
        RolloutInput: {
            "messages",
            "tools",
            "ground_truth",
            "rollout_extra",
            "sampling_params",
            "model_resource",
            "request_metadata",
        },
        AgentOutput: {"messages", "rollout_extra", "rollout_metrics", "reward_score"},
        RolloutOutput: {"agent_output", "status", "error"},
        RewardInput: {"ground_truth", "request_metadata", "agent_output"},
        Reward: {"reward_score", "reward_metrics"},
        RewardOutput: {"reward", "status", "error"},
    }
    # Ours on top of Bailian's: the other models a job serves to processors (job field auxiliary_models).
    extensions = {RolloutInput: {"auxiliary_models"}, RewardInput: {"auxiliary_models"}}
    for model, fields in expected.items():
        assert set(model.model_fields) == fields | extensions.get(model, set()), model.__name__
    assert {s.value for s in TaskStatus} == {"SUCCESS", "FAILED"}
    assert TaskStatus.FAILED == "FAILED"
    assert RequestMetadata(job_id="j", sample_id="s", rollout_id="r").attempt_id == 0
    assert RolloutOutput().status is TaskStatus.SUCCESS
    assert RewardOutput().reward is None
    assert AgentOutput(messages=[]).rollout_metrics == {}
    assert callable(observe_processor) and callable(trace_client)


def test_bailian_local_test_input_needs_no_request_metadata() -> None:
    # Bailian's local-test advice, verbatim: three fields plus rollout_extra, no request_metadata.
    mock_input = RolloutInput(
        model_resource=ModelResource(model_name="", base_url="", api_key=""),
        sampling_params={"temperature": 0.2, "max_tokens": 512, "timeout": 60.0},
        messages=[{"role": "user", "content": "查询项目 P100 的状态"}],
        rollout_extra={"sample_id": "test-001"},
    )
    assert mock_input.request_metadata is None and mock_input.ground_truth is None
    reward_input = RewardInput(ground_truth=None, agent_output=_agent_output())
    assert reward_input.request_metadata is None
    assert pickle.loads(pickle.dumps(mock_input)) == mock_input


GROUND_TRUTHS = [
    '{"decision": "clarify", "mentions": ["编号"]}',
    42,
    4.5,
    True,
    {"decision": "tool_call", "tool_calls": [{"name": "query_status", "arguments": {"item_id": "P100"}}]},
    ["a", 1, None],
    None,
]


@pytest.mark.parametrize("value", GROUND_TRUTHS)
def test_ground_truth_is_any_json_value_kept_as_given(value: object) -> None:
    rollout_input = RolloutInput.model_validate({**_rollout_input().model_dump(), "ground_truth": value})
    reward_input = RewardInput(ground_truth=value, agent_output=_agent_output())
    for model in (rollout_input, reward_input):
        assert model.ground_truth == value and type(model.ground_truth) is type(value)
        assert pickle.loads(pickle.dumps(model)).ground_truth == value
    assert RewardInput.model_validate_json(reward_input.model_dump_json()).ground_truth == value


def test_ground_truth_must_be_json() -> None:
    with pytest.raises(ValidationError, match="ground_truth"):
        RewardInput(ground_truth=object(), agent_output=_agent_output())  # type: ignore[arg-type]


@pytest.mark.parametrize("value", GROUND_TRUTHS)
def test_the_trainer_passes_the_stored_ground_truth_through(value: object) -> None:
    from opd_trainer.jobspec.dataset import Sample, ground_truth_of

    def sample(extra: dict[str, object]) -> Sample:
        return Sample("train.jsonl", 1, [{"role": "user", "content": "hi"}], None, extra)

    assert ground_truth_of(sample({"solution": value})) == value
    assert type(ground_truth_of(sample({"solution": value}))) is type(value)
    # An explicit ground_truth wins over solution, as documented in opd_trainer/rollout/runner.py.
    assert ground_truth_of(sample({"ground_truth": value, "solution": "other"})) == value
    assert ground_truth_of(sample({})) is None


def test_inputs_accept_unknown_fields_outputs_reject_them() -> None:
    data = _rollout_input().model_dump()
    data["model_resource"]["api_key"] = SECRET
    data["future_field"] = 1
    assert RolloutInput.model_validate(data).model_extra == {"future_field": 1}
    with pytest.raises(ValidationError, match="reward_scores"):
        Reward(reward_score=1.0, reward_scores={})  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        AgentOutput(messages=[], rollout_metrics={"turns": "many"})


def test_every_model_pickles() -> None:
    agent_output = _agent_output()
    models = [
        _rollout_input(),
        _metadata(),
        _rollout_input().model_resource,
        agent_output,
        RolloutOutput(agent_output=agent_output),
        RolloutOutput(status=TaskStatus.FAILED, error="boom"),
        RewardInput(ground_truth="42", request_metadata=_metadata(), agent_output=agent_output),
        Reward(reward_score=1.0, reward_metrics={"format": 0.5}),
        RewardOutput(reward=Reward(reward_score=1.0)),
        TaskStatus.FAILED,
    ]
    for model in models:
        restored = pickle.loads(pickle.dumps(model))
        assert restored == model
        assert type(restored) is type(model)
    restored_input = pickle.loads(pickle.dumps(_rollout_input()))
    assert restored_input.model_resource.api_key.get_secret_value() == SECRET


def test_api_key_is_secret() -> None:
    rollout_input = _rollout_input()
    assert isinstance(rollout_input.model_resource.api_key, SecretStr)
    for text in (repr(rollout_input), str(rollout_input), rollout_input.model_dump_json()):
        assert SECRET not in text
    assert rollout_input.model_resource.api_key.get_secret_value() == SECRET


class _AsyncRollout(AbstractRolloutProcessor):
    async def process(self, rollout_input: RolloutInput) -> RolloutOutput:
        self.thread = threading.get_ident()
        return RolloutOutput(agent_output=AgentOutput(messages=rollout_input.messages))


class _SyncRollout(AbstractRolloutProcessor):
    def process(self, rollout_input: RolloutInput) -> RolloutOutput:
        self.thread = threading.get_ident()
        return RolloutOutput(agent_output=AgentOutput(messages=rollout_input.messages))


class _SyncDictReward(AbstractRewardProcessor):
    def process(self, reward_input: RewardInput) -> RewardOutput:
        return {"reward": {"reward_score": 1.0}}  # type: ignore[return-value]


class _WrongType(AbstractRewardProcessor):
    async def process(self, reward_input: RewardInput) -> RewardOutput:
        return 1.0  # type: ignore[return-value]


def test_call_processor_awaits_async_and_threads_sync() -> None:
    async def run() -> tuple[int, _AsyncRollout, _SyncRollout]:
        loop_thread = threading.get_ident()
        async_processor, sync_processor = _AsyncRollout(), _SyncRollout()
        for processor in (async_processor, sync_processor):
            output = await call_processor(processor, _rollout_input())
            assert isinstance(output, RolloutOutput)
            assert output.agent_output is not None and output.agent_output.messages[0]["content"] == "hi"
        return loop_thread, async_processor, sync_processor

    loop_thread, async_processor, sync_processor = asyncio.run(run())
    assert async_processor.thread == loop_thread
    assert sync_processor.thread != loop_thread


def test_call_processor_does_not_block_the_loop_on_sync_work() -> None:
    release = threading.Event()

    class Blocking(AbstractRolloutProcessor):
        def process(self, rollout_input: RolloutInput) -> RolloutOutput:
            assert release.wait(5)
            return RolloutOutput(agent_output=AgentOutput(messages=[]))

    async def run() -> RolloutOutput:
        pending = asyncio.create_task(call_processor(Blocking(), _rollout_input()))
        await asyncio.sleep(0.01)  # the loop still runs while process() blocks its thread
        release.set()
        return await pending

    assert asyncio.run(run()).status is TaskStatus.SUCCESS


def test_call_processor_validates_outputs() -> None:
    reward_input = RewardInput(request_metadata=_metadata(), agent_output=_agent_output())
    output = asyncio.run(call_processor(_SyncDictReward(), reward_input))
    assert isinstance(output, RewardOutput) and output.reward == Reward(reward_score=1.0)
    with pytest.raises(TypeError, match=r"_WrongType.process returned float, expected RewardOutput"):
        asyncio.run(call_processor(_WrongType(), reward_input))


def test_abstract_processors_need_process() -> None:
    class Incomplete(AbstractRolloutProcessor):
        pass

    with pytest.raises(TypeError):
        Incomplete()  # type: ignore[abstract]
    assert _SyncRollout().setup() is None


@pytest.mark.parametrize(
    ("output", "failed"),
    [
        (RolloutOutput(agent_output=_agent_output()), False),
        (RolloutOutput(agent_output=_agent_output(), status=TaskStatus.FAILED, error="x"), True),
        (RolloutOutput(), True),
        (RolloutOutput(agent_output=_agent_output("ROLLOUT_ERROR: tool crashed")), True),
        (RolloutOutput(agent_output=_agent_output("  ROLLOUT_ERROR: leading space")), True),
        (RolloutOutput(agent_output=_agent_output([{"type": "text", "text": "ROLLOUT_ERROR: x"}])), True),
        (RolloutOutput(agent_output=_agent_output("the answer mentions ROLLOUT_ERROR: late")), False),
        (RolloutOutput(agent_output=_agent_output(None)), False),
        (
            RolloutOutput(
                agent_output=AgentOutput(
                    messages=[{"role": "user", "content": "ROLLOUT_ERROR: not assistant"}]
                )
            ),
            False,
        ),
    ],
)
def test_is_rollout_failure(output: RolloutOutput, failed: bool) -> None:
    assert is_rollout_failure(output) is failed


def test_openai_client_shares_one_pool_per_loop_and_swaps_the_key() -> None:
    def resource(key: str, url: str = "http://127.0.0.1:9/v1") -> ModelResource:
        return ModelResource(model_name="student", base_url=url, api_key=SecretStr(key))

    async def clients() -> list:
        return [
            resource("k1").openai_client(),
            resource("k2").openai_client(),
            resource("k3", "http://h/v1").openai_client(),
        ]

    first, second, other_url = asyncio.run(clients())
    assert (first.api_key, second.api_key) == ("k1", "k2")
    assert first._client is second._client  # one connection pool for the loop and base URL
    # openai's aiohttp transport: httpx's own pool probes every idle connection on each request.
    assert isinstance(first._client, openai.DefaultAioHttpClient)
    assert other_url._client is first._client  # one pool per loop, whichever gateway it calls
    assert str(other_url.base_url) == "http://h/v1/" and str(first.base_url) == "http://127.0.0.1:9/v1/"
    assert first.max_retries == 0  # a retried call would be recorded twice by the gateway
    # Computed once: openai computes a client's platform on its first request in a new thread, and a
    # per-rollout copy would make one such thread hop per call.
    assert first._platform is not None and second._platform is first._platform
    assert trace_client(first) is first  # already traced
    [next_loop, *_] = asyncio.run(clients())
    assert next_loop._client is not first._client  # a new loop never reuses another loop's pool
