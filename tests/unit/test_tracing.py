"""Tracing: processor spans with request ids, `llm.call` child spans, per-rollout collection, OTLP set-up."""

from __future__ import annotations

import asyncio
import importlib
import json
import threading
import uuid
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

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
    tracing,
)
from opd_trainer.sdk.tracing import collect_spans, configure_tracing, ensure_observed

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


def test_trace_client_instruments_in_place_and_returns_the_client() -> None:
    rid = new_id()
    client = fake_client(FakeSyncCompletions())
    assert trace_client(client) is client  # Bailian's `trace_client(llm)` discards this
    assert trace_client(client) is client  # a second call must not add a second span per call
    assert getattr(client.chat.completions.create, tracing.TRACED_MARKER) is True

    @observe_processor
    def process(rollout_input: RolloutInput) -> RolloutOutput:
        assert client.chat.completions.create(model="m", messages=[]) is RESPONSE
        return RolloutOutput(agent_output=AgentOutput(messages=[]))

    process(rollout_input(rid))
    assert [s["name"] for s in collect_spans(rid)] == ["process", "llm.call"]


def test_trace_client_leaves_what_it_cannot_trace_alone(caplog: pytest.LogCaptureFixture) -> None:
    thing = SimpleNamespace(answer=42)
    assert trace_client(thing) is thing and vars(thing) == {"answer": 42}
    assert "no OpenAI chat.completions client" in caplog.text


# -- real openai / LangChain clients -----------------------------------------------------------

# openai >= 3 talks through `httpx2`, earlier versions through `httpx`: the transport below must come
# from the library the installed openai uses.
openai_http = importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0])

COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "student",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call-1",
                        "type": "function",
                        "function": {"name": "query_status", "arguments": '{"item_id": "P100"}'},
                    }
                ],
            },
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "query_status",
            "parameters": {"type": "object", "properties": {"item_id": {"type": "string"}}},
        },
    }
]


class CannedHTTP:
    """The HTTP layer answered in-process with one fixed completion, so the real openai and LangChain
    client code (request building, raw responses, parsing) runs without a server; every request's
    key and JSON body are kept in `requests`."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []
        transport = openai_http.MockTransport(self._answer)
        self.sync = openai_http.Client(transport=transport)
        self.async_ = openai_http.AsyncClient(transport=transport)

    def _answer(self, request: Any) -> Any:
        self.requests.append((request.headers["authorization"], json.loads(request.content)))
        return openai_http.Response(200, json=COMPLETION)


def llm_spans(rid: str) -> list[dict[str, Any]]:
    return [s for s in collect_spans(rid) if s["name"] == "llm.call"]


def run_in_rollout(rid: str, call: Any) -> None:
    """Runs `call()` (a coroutine function) inside a processor span for rollout `rid`."""

    @observe_processor
    async def process(rollout_input: RolloutInput) -> RolloutOutput:
        await call()
        return RolloutOutput(agent_output=AgentOutput(messages=[]))

    asyncio.run(process(rollout_input(rid)))


def chat_openai(http: CannedHTTP) -> Any:
    from langchain_openai import ChatOpenAI

    # Constructed as Bailian's rollout template does (openai_api_key / openai_api_base, extra_body).
    return ChatOpenAI(
        model="student",
        openai_api_key="per-rollout-key",
        openai_api_base="http://gateway/v1",
        temperature=0.2,
        max_tokens=32,
        extra_body={"enable_thinking": False},
        streaming=False,
        http_client=http.sync,
        http_async_client=http.async_,
    )


@pytest.mark.parametrize("style", ["discard", "assign"])
def test_langchain_chat_openai_bind_tools_records_one_span_per_call(style: str) -> None:
    from langchain_core.messages import HumanMessage

    http = CannedHTTP()
    llm = chat_openai(http)
    if style == "discard":
        trace_client(llm)  # Bailian's documented call
    else:
        llm = trace_client(llm)
    model = llm.bind_tools(TOOLS, tool_choice="auto")  # bound after tracing, as in the template
    rid = new_id()

    async def calls() -> None:
        response = await model.ainvoke([HumanMessage(content="查询项目 P100 的状态")])
        assert response.tool_calls[0]["args"] == {"item_id": "P100"}
        await model.ainvoke([HumanMessage(content="again")])
        assert model.invoke([HumanMessage(content="sync")]).tool_calls  # LangChain's sync path

    run_in_rollout(rid, calls)
    spans = llm_spans(rid)
    assert len(spans) == 3 == len(http.requests)
    assert all(s["attributes"]["opd.rollout_id"] == rid for s in spans)
    assert spans[0]["attributes"] | {"llm.num_tools": 1, "llm.tool_calls": 1} == spans[0]["attributes"]
    assert spans[0]["attributes"]["llm.usage.total_tokens"] == 18  # parsed from LangChain's raw response
    assert http.requests[0][1]["enable_thinking"] is False  # extra_body reaches the request body


def test_langchain_binding_made_before_tracing_and_tracing_a_binding() -> None:
    http = CannedHTTP()
    llm = chat_openai(http)
    early = llm.bind_tools(TOOLS)
    trace_client(llm.bind_tools(TOOLS))  # tracing a binding traces the model it wraps
    trace_client(llm)  # and tracing the model again is a no-op
    rid = new_id()

    async def calls() -> None:
        await early.ainvoke("hi")
        await llm.ainvoke("hi")

    run_in_rollout(rid, calls)
    assert len(llm_spans(rid)) == 2 == len(http.requests)


def test_openai_clients_traced_in_place_including_raw_responses() -> None:
    http = CannedHTTP()
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="k", http_client=http.async_)
    raw_before = client.chat.completions.with_raw_response  # a view built before tracing
    trace_client(client)
    rid = new_id()

    async def calls() -> None:
        await client.chat.completions.create(model="student", messages=[{"role": "user", "content": "a"}])
        raw = await raw_before.create(model="student", messages=[{"role": "user", "content": "b"}])
        assert raw.parse().choices[0].finish_reason == "tool_calls"
        await client.with_raw_response.chat.completions.create(model="student", messages=[])

    run_in_rollout(rid, calls)
    spans = llm_spans(rid)
    assert len(spans) == 3 == len(http.requests)
    assert [s["attributes"]["llm.tool_calls"] for s in spans] == [1, 1, 1]


def test_a_client_derived_from_a_traced_one_is_traced_and_the_original_untouched() -> None:
    http = CannedHTTP()
    plain = openai.OpenAI(base_url="http://gateway/v1", api_key="k0", http_client=http.sync)
    traced = trace_client(plain.with_options(api_key="k1"))
    derived = traced.with_options(api_key="k2", timeout=5)
    rid = new_id()

    async def calls() -> None:
        for client in (plain, traced, derived):
            client.chat.completions.create(model="student", messages=[])

    run_in_rollout(rid, calls)
    assert [key for key, _ in http.requests] == ["Bearer k0", "Bearer k1", "Bearer k2"]
    assert len(llm_spans(rid)) == 2  # `plain` was never traced
    assert not hasattr(plain.chat.completions.create, tracing.TRACED_MARKER)


def test_model_resource_clients_share_a_pool_trace_once_and_keep_their_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opd_trainer.sdk import types

    http = CannedHTTP()
    monkeypatch.setattr(types, "_http_client", lambda: http.async_)
    rid = new_id()

    def resource(key: str) -> ModelResource:
        return ModelResource(model_name="student", base_url="http://gateway/v1", api_key=key)

    async def calls() -> None:
        first, second = resource("k1").openai_client(), resource("k2").openai_client()
        trace_client(first)  # user code tracing an already traced client again
        for client in (first, second, trace_client(first)):
            await client.chat.completions.create(model="student", messages=[])
        [shared] = types._SHARED_CLIENTS[asyncio.get_running_loop()].values()
        assert not hasattr(shared.chat.completions.create, tracing.TRACED_MARKER)

    run_in_rollout(rid, calls)
    assert [key for key, _ in http.requests] == ["Bearer k1", "Bearer k2", "Bearer k1"]
    assert len(llm_spans(rid)) == 3


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
