"""Tracing: processor spans with request ids, `llm.call` child spans, per-rollout collection, OTLP set-up."""

from __future__ import annotations

import asyncio
import threading
import uuid
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from opd_trainer import tracing
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
    observe_processor,
    trace_client,
)
from opd_trainer.tracing import collect_spans, configure_tracing, ensure_observed

RESPONSE = {
    "model": "student",
    "choices": [
        {
            "message": {"role": "assistant", "tool_calls": [{"id": "a"}, {"id": "b"}]},
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
}


class FakeAsyncCompletions:
    async def create(self, **kwargs: Any) -> dict[str, Any]:
        return RESPONSE


class FakeSyncCompletions:
    def create(self, **kwargs: Any) -> dict[str, Any]:
        return RESPONSE


def fake_client(completions: Any) -> Any:
    return SimpleNamespace(chat=SimpleNamespace(completions=completions), api_key="k")


@pytest.fixture(autouse=True)
def _configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    configure_tracing("opd-unit-tests")


def rollout_input(rollout_id: str, content: str = "hi") -> RolloutInput:
    return RolloutInput(
        messages=[{"role": "user", "content": content}],
        tools=[{"type": "function", "function": {"name": "search"}}],
        model_resource=ModelResource(model_name="student", base_url="http://gw/v1", api_key="secret"),
        request_metadata=RequestMetadata(
            job_id="job-7", sample_id="s-3", rollout_id=rollout_id, attempt_id=1
        ),
    )


class AgentRollout(AbstractRolloutProcessor):
    @observe_processor
    async def process(self, rollout_input: RolloutInput) -> RolloutOutput:
        client = trace_client(fake_client(FakeAsyncCompletions()))
        response = await client.chat.completions.create(
            model=rollout_input.model_resource.model_name, messages=rollout_input.messages, tools=[]
        )
        if rollout_input.messages[0]["content"] == "explode":
            raise ValueError("agent crashed")
        if rollout_input.messages[0]["content"] == "fail":
            return RolloutOutput(status=TaskStatus.FAILED, error="tool timed out")
        return RolloutOutput(agent_output=AgentOutput(messages=[response["choices"][0]["message"]]))


class SyncRollout(AbstractRolloutProcessor):
    def process(self, rollout_input: RolloutInput) -> RolloutOutput:
        self.thread = threading.get_ident()
        trace_client(fake_client(FakeSyncCompletions())).chat.completions.create(
            model="student", messages=rollout_input.messages
        )
        return RolloutOutput(agent_output=AgentOutput(messages=[{"role": "assistant", "content": "ok"}]))


def new_id() -> str:
    return f"r-{uuid.uuid4().hex[:8]}"


def by_name(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {span["name"]: span for span in spans}


def test_rollout_span_with_llm_child_collected_once() -> None:
    rid = new_id()
    output = asyncio.run(AgentRollout().process(rollout_input(rid)))
    assert output.agent_output is not None  # returned unchanged

    spans = collect_spans(rid)
    assert [s["name"] for s in spans] == ["AgentRollout", "llm.call"]
    rollout, llm = by_name(spans)["AgentRollout"], by_name(spans)["llm.call"]
    assert (
        rollout["attributes"]
        | {
            "opd.kind": "rollout",
            "opd.job_id": "job-7",
            "opd.sample_id": "s-3",
            "opd.rollout_id": rid,
            "opd.attempt_id": 1,
            "opd.status": "SUCCESS",
        }
        == rollout["attributes"]
    )
    assert rollout["status"] == "OK"
    assert llm["parent_span_id"] == rollout["span_id"]
    assert llm["trace_id"] == rollout["trace_id"]
    assert (
        llm["attributes"]
        | {
            "opd.rollout_id": rid,
            "llm.model": "student",
            "llm.num_messages": 1,
            "llm.num_tools": 0,
            "llm.tool_calls": 2,
            "llm.finish_reasons": ["tool_calls"],
            "llm.usage.prompt_tokens": 11,
            "llm.usage.completion_tokens": 7,
            "llm.usage.total_tokens": 18,
        }
        == llm["attributes"]
    )
    assert rollout["start_ns"] <= llm["start_ns"] <= llm["end_ns"] <= rollout["end_ns"]

    assert collect_spans(rid) == []


def test_exception_ends_span_with_error_and_reraises() -> None:
    rid = new_id()
    with pytest.raises(ValueError, match="agent crashed"):
        asyncio.run(AgentRollout().process(rollout_input(rid, "explode")))
    rollout = by_name(collect_spans(rid))["AgentRollout"]
    assert rollout["status"] == "ERROR"
    assert rollout["error"] == "ValueError: agent crashed"
    assert rollout["end_ns"] is not None
    assert [e["name"] for e in rollout["events"]] == ["exception"]


def test_failed_output_marks_span_error() -> None:
    rid = new_id()
    output = asyncio.run(AgentRollout().process(rollout_input(rid, "fail")))
    assert output.status is TaskStatus.FAILED
    rollout = by_name(collect_spans(rid))["AgentRollout"]
    assert (rollout["status"], rollout["error"]) == ("ERROR", "tool timed out")
    assert rollout["attributes"]["opd.status"] == "FAILED"


def test_sync_processor_in_thread_nests_llm_span() -> None:
    rid = new_id()
    processor = ensure_observed(SyncRollout())
    assert getattr(processor.process, tracing.OBSERVED_MARKER) is True
    assert ensure_observed(processor).process is processor.process  # not wrapped twice

    async def run() -> int:
        await call_processor(processor, rollout_input(rid))
        return threading.get_ident()

    assert asyncio.run(run()) != processor.thread
    spans = by_name(collect_spans(rid))
    assert set(spans) == {"SyncRollout", "llm.call"}
    assert spans["llm.call"]["parent_span_id"] == spans["SyncRollout"]["span_id"]


def test_observe_processor_marks_and_does_not_double_wrap() -> None:
    wrapped = AgentRollout.process
    assert getattr(wrapped, tracing.OBSERVED_MARKER) is True
    assert observe_processor(wrapped) is wrapped
    processor = AgentRollout()
    bound = processor.process
    assert ensure_observed(processor) is processor and processor.__dict__.get("process") is None
    assert bound.__func__ is wrapped


def test_reward_span_joins_the_rollout() -> None:
    rid = new_id()

    class Judge(AbstractRewardProcessor):
        async def process(self, reward_input: RewardInput) -> RewardOutput:
            return RewardOutput(reward=Reward(reward_score=0.25))

    judge = ensure_observed(Judge())
    reward_input = RewardInput(
        request_metadata=rollout_input(rid).request_metadata, agent_output=AgentOutput(messages=[])
    )
    asyncio.run(call_processor(judge, reward_input))
    (span,) = collect_spans(rid)
    assert span["name"] == "Judge"
    assert span["attributes"]["opd.kind"] == "reward"
    assert span["attributes"]["opd.reward_score"] == 0.25


def test_tracing_failure_never_breaks_user_code(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> Any:
        raise RuntimeError("tracer down")

    monkeypatch.setattr(tracing, "_tracer", broken)
    rid = new_id()
    output = asyncio.run(AgentRollout().process(rollout_input(rid)))
    assert output.agent_output is not None
    assert collect_spans(rid) == []


def test_trace_client_is_a_transparent_proxy() -> None:
    client = fake_client(FakeSyncCompletions())
    traced = trace_client(client)
    assert trace_client(traced) is traced
    assert traced.api_key == "k"
    traced.api_key = "k2"
    assert client.api_key == "k2"
    assert traced.chat.completions.create(model="m", messages=[]) is RESPONSE


def test_real_async_openai_client_error_is_recorded() -> None:
    rid = new_id()
    client = trace_client(
        openai.AsyncOpenAI(api_key="x", base_url="http://127.0.0.1:9/v1", max_retries=0, timeout=5)
    )

    @observe_processor
    async def process(rollout_input: RolloutInput) -> RolloutOutput:
        await client.chat.completions.create(model="student", messages=rollout_input.messages)
        raise AssertionError("unreachable")

    with pytest.raises(openai.APIConnectionError):
        asyncio.run(process(rollout_input(rid)))
    spans = by_name(collect_spans(rid))
    assert spans["llm.call"]["status"] == "ERROR"
    assert spans["llm.call"]["parent_span_id"] == spans["process"]["span_id"]


def test_collector_keeps_only_the_newest_spans() -> None:
    collector = tracing.RolloutSpanCollector(max_spans=3)
    provider = TracerProvider()
    provider.add_span_processor(collector)
    tracer = provider.get_tracer("test")
    for i in range(5):
        with tracer.start_as_current_span("rollout", attributes={"opd.rollout_id": f"c{i}"}):
            pass
    with tracer.start_as_current_span("unrelated"):
        pass
    assert [collector.collect(f"c{i}") != [] for i in range(5)] == [False, False, True, True, True]
    assert collector._stored == 0 and not collector._open


def test_otlp_exporter_only_when_endpoint_set(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tracing._otlp_span_processor() is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    processor = tracing._otlp_span_processor()
    assert isinstance(processor, BatchSpanProcessor)
    processor.shutdown()


def test_configure_tracing_is_idempotent() -> None:
    provider = tracing._provider
    configure_tracing("another-name")
    assert tracing._provider is provider
