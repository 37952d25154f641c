"""A rollout key's recorded calls come back over HTTP to the holder of the gateway's close secret only
(`opd_trainer/recorded_calls.py`: the gateway's close route, or a completion sent with the secret), bit
for bit; a rollout worker returns them with the rollout's answer, read from the gateway, never from
what the sandboxed user code says.

The gateway is a real `Gateway` served by uvicorn in the test's loop, with no engine (its calls are
recorded by hand) or a stand-in one; the worker is a real `ProcessorWorker` (no Ray) running a hostile
processor in its sandbox.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from opd_trainer.jobspec.job_spec import FunctionComponent
from opd_trainer.recorded_calls import (
    CLOSE_ROUTE,
    CLOSE_SECRET_HEADER,
    REOPEN_ROUTE,
    GatewayKey,
    close_keys,
    decode_recorded,
    decode_with_record,
    encode_recorded,
    reopen_key,
)
from opd_trainer.records import LLMCall
from opd_trainer.rollout import gateway as gateway_module
from opd_trainer.rollout.gateway import Gateway, RolloutKeyRequest
from opd_trainer.sdk import ModelResource, RolloutInput, TaskStatus
from opd_trainer.storage.zips import pack_workspace
from opd_trainer.workers import sandbox
from opd_trainer.workers.pool import ProcessorWorker, WorkerCall

pytestmark = pytest.mark.timeout(120)

WORDS = ["[UNK]", "<|im_start|>", "<|im_end|>", "user", "assistant", "hello", "world"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def recorded_call(seed: int) -> LLMCall:
    """A call as a gateway records it, with floats whose text form is easy to get wrong."""
    return LLMCall(
        prompt_token_ids=[seed, 151644, 0],
        completion_token_ids=[7, seed + 1],
        sampler_logprobs=[-0.1 + seed * 1e-17, float("-inf")],
        weight_version=3,
        finish_reason="stop",
        text="ok ✓",
        messages=[{"role": "user", "content": f"q{seed}"}],
        tools=None,
        template_kwargs={"enable_thinking": False},
        response_message={"role": "assistant", "content": "ok ✓"},
        format_valid=False,
        latency_s=1 / 3,
    )


def test_the_encoding_round_trips_every_recorded_field_bit_for_bit() -> None:
    recorded = [[recorded_call(1), recorded_call(2)], [], None]
    assert decode_recorded(encode_recorded(recorded)) == recorded


async def _served(
    run: Callable[[Gateway, aiohttp.ClientSession], Awaitable[Any]],
    tokenizer: str = "unused-tokenizer",
    engines: list[Any] | None = None,
) -> Any:
    gateway = Gateway("student", tokenizer, engines or [], max_tokens=8, temperature=1.0, max_length=256)
    await gateway.serve()
    try:
        async with aiohttp.ClientSession() as http:
            return await run(gateway, http)
    finally:
        await gateway.shutdown()


def _open_with_calls(gateway: Gateway, count: int) -> list[str]:
    keys = gateway.open_rollouts([RolloutKeyRequest(f"r{i}") for i in range(count)])
    for i, key in enumerate(keys):
        gateway._sessions[key].calls.append(recorded_call(i))
    return keys


def test_the_secret_closes_keys_and_returns_each_ones_calls() -> None:
    async def run(gateway: Gateway, http: aiohttp.ClientSession) -> None:
        keys = _open_with_calls(gateway, 3)
        closed = await close_keys(http, gateway.base_url, gateway.close_secret, [keys[2], keys[0]])
        assert closed == [[recorded_call(2)], [recorded_call(0)]]
        assert list(gateway._sessions) == [keys[1]]
        # A key closed already answers its record again (a fallback close after a lost answer); one
        # the gateway never opened answers null.
        again = await close_keys(http, gateway.base_url, gateway.close_secret, [keys[0], "x"])
        assert again == [[recorded_call(0)], None]

    asyncio.run(_served(run))


def test_only_the_last_closed_keys_keep_their_record(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway_module, "CLOSED_KEYS_KEPT", 2)
    gateway = Gateway("student", "unused-tokenizer", [], max_tokens=8, temperature=1.0, max_length=256)
    keys = _open_with_calls(gateway, 3)
    assert [gateway.close_rollout(key) for key in keys] == [[recorded_call(i)] for i in range(3)]
    assert [gateway.close_rollout(key) for key in keys] == [None, [recorded_call(1)], [recorded_call(2)]]
    assert list(gateway._closed) == keys[1:]


def test_a_closed_key_reopens_with_its_record_for_the_holder_of_the_secret() -> None:
    """A retried rollout's worker reopens its key (the lost attempt's worker may have closed it): the
    record goes on where it was, as if the key had stayed open."""

    async def run(gateway: Gateway, http: aiohttp.ClientSession) -> None:
        [key] = _open_with_calls(gateway, 1)
        gateway._sessions[key].started_calls = 1
        assert await close_keys(http, gateway.base_url, gateway.close_secret, [key]) == [[recorded_call(0)]]
        url = f"{gateway.base_url}{REOPEN_ROUTE}"
        async with http.post(url, json={"keys": [key]}, headers={CLOSE_SECRET_HEADER: key}) as refused:
            assert refused.status == 401
        assert key not in gateway._sessions
        assert await reopen_key(http, GatewayKey(gateway.base_url, key, gateway.close_secret), 5.0)
        session = gateway._sessions[key]
        assert session.calls == [recorded_call(0)] and session.started_calls == 1
        assert not await reopen_key(http, GatewayKey(gateway.base_url, "x", gateway.close_secret), 5.0)

    asyncio.run(_served(run))


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {CLOSE_SECRET_HEADER: "guessed"},
        {"Authorization": "Bearer {key}"},  # a rollout's own key is no credential here
        {"Authorization": "Bearer {key}", CLOSE_SECRET_HEADER: "{key}"},
    ],
)
def test_without_the_secret_nothing_is_closed_or_read(headers: dict[str, str]) -> None:
    async def run(gateway: Gateway, http: aiohttp.ClientSession) -> None:
        [key] = _open_with_calls(gateway, 1)
        sent = {name: value.format(key=key) for name, value in headers.items()}
        url = f"{gateway.base_url}{CLOSE_ROUTE}"
        async with http.post(url, json={"keys": [key]}, headers=sent) as response:
            assert response.status == 401
            assert "ok" not in await response.text()
        assert gateway._sessions[key].calls == [recorded_call(0)]  # still open, still whole

    asyncio.run(_served(run))


def test_a_malformed_close_body_is_refused() -> None:
    async def run(gateway: Gateway, http: aiohttp.ClientSession) -> None:
        headers = {CLOSE_SECRET_HEADER: gateway.close_secret}
        for body in ({"keys": "k"}, {"keys": [1]}, ["k"], {}):
            async with http.post(f"{gateway.base_url}{CLOSE_ROUTE}", json=body, headers=headers) as response:
                assert response.status == 400, body

    asyncio.run(_served(run))


class OneTokenEngine:
    """A stand-in engine replica: every call samples token 5 ("hello")."""

    def __init__(self) -> None:
        self.sampled = 0

    async def sample(self, prompt_token_ids: list[int], params: Any, client: str | None) -> Any:
        from vllm.logprobs import Logprob

        from opd_trainer.engine.vllm_engine import Sampled

        self.sampled += 1
        call = LLMCall(list(prompt_token_ids), [5], [-0.5], text="hello", finish_reason="stop")
        return Sampled(call, [{5: Logprob(-0.5, rank=1, decoded_token="hello")}])


def test_a_completion_sent_with_the_secret_closes_its_key_and_answers_its_record(tmp_path: Path) -> None:
    """The built-in rollout's one request: the completion and the key's record in one answer; without
    the right secret nothing is sampled, and a closing call is never streamed."""
    from chatml_tokenizer import save_chatml_tokenizer

    tokenizer = str(save_chatml_tokenizer(tmp_path, TEMPLATE, WORDS))
    engine = OneTokenEngine()
    body = {"model": "student", "messages": [{"role": "user", "content": "hello world"}]}

    async def run(gateway: Gateway, http: aiohttp.ClientSession) -> None:
        [key, other] = gateway.open_rollouts([RolloutKeyRequest("r0"), RolloutKeyRequest("r1")])
        url = f"{gateway.base_url}/chat/completions"
        bearer = {"Authorization": f"Bearer {key}"}
        async with http.post(url, json=body, headers={**bearer, CLOSE_SECRET_HEADER: "wrong"}) as refused:
            assert refused.status == 401
        streamed = {**body, "stream": True}
        closing = {**bearer, CLOSE_SECRET_HEADER: gateway.close_secret}
        async with http.post(url, json=streamed, headers=closing) as refused:
            assert refused.status == 400
        assert engine.sampled == 0 and gateway._sessions[key].calls == []
        async with http.post(url, json=body, headers=closing) as response:
            assert response.status == 200
            completion, calls = decode_with_record(await response.read())
        assert completion["choices"][0]["message"]["content"] == "hello"
        [call] = calls
        assert call.completion_token_ids == [5] and call.sampler_logprobs == [-0.5]
        assert call.response_message["content"] == "hello" and call.messages == body["messages"]
        assert list(gateway._sessions) == [other]  # closed with its call; the other key untouched

    asyncio.run(_served(run, tokenizer, [engine]))


HOSTILE = """
import json
import os
import urllib.error
import urllib.request

from opd_trainer.sdk import AbstractRolloutProcessor, AgentOutput, RolloutOutput


def close_status(base_url, key, headers):
    body = json.dumps({"keys": [key]}).encode()
    request = urllib.request.Request(base_url + "/rollouts/close", data=body, headers=headers, method="POST")
    try:
        return urllib.request.urlopen(request, timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code


class Forger(AbstractRolloutProcessor):
    async def process(self, rollout_input):
        resource = rollout_input.model_resource
        key = resource.api_key.get_secret_value()
        seen = json.dumps(rollout_input.model_dump(mode="json")) + json.dumps(dict(os.environ))
        statuses = {
            "close_with_own_key": close_status(
                resource.base_url, key, {"Authorization": "Bearer " + key, "Content-Type": "application/json"}
            ),
            "close_with_key_as_secret": close_status(
                resource.base_url, key, {"X-OPD-Close-Secret": key, "Content-Type": "application/json"}
            ),
        }
        forged = {"prompt_token_ids": [1], "completion_token_ids": [666], "sampler_logprobs": [0.0]}
        output = RolloutOutput(agent_output=AgentOutput(
            messages=[{"role": "assistant", "content": seen}],
            rollout_metrics={name: float(status) for name, status in statuses.items()},
            rollout_extra={"calls": [forged]},
        ))
        return output
"""

MODES = [
    "none",
    pytest.param("bwrap", marks=pytest.mark.skipif(sandbox.bwrap_problem() is not None, reason="no bwrap")),
]


async def _worker_answers(worker: ProcessorWorker, calls: list[WorkerCall]) -> list[tuple[int, Any]]:
    stream: AsyncIterator[tuple[int, dict[str, Any]]] = worker.calls(calls)
    return [item async for item in stream]


@pytest.mark.parametrize("mode", MODES)
def test_a_rollouts_record_comes_from_the_gateway_never_from_its_sandbox(tmp_path: Path, mode: str) -> None:
    """The worker closes the rollout's key itself and returns what the gateway recorded: user code
    that tries to close its key (with the key, or the key as the secret) is refused, never sees the
    secret, and what it returns as calls is ignored."""
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "forger.py").write_text(textwrap.dedent(HOSTILE))
    component = FunctionComponent.model_validate(
        {
            "name": "forger",
            "type": "rollout",
            "fcmodel": {"zipdir": str(workspace), "classpath": "forger.py:Forger"},
            "runtime": {"concurrency": 2, "memory_size": 1024},
        }
    )

    async def run(gateway: Gateway, http: aiohttp.ClientSession) -> None:
        keys = _open_with_calls(gateway, 2)
        worker = ProcessorWorker(pack_workspace(workspace), component, "rollout", [], mode, "gateway", False)
        await worker.load()
        try:
            calls = [
                WorkerCall(
                    RolloutInput(
                        messages=[{"role": "user", "content": "hi"}],
                        model_resource=ModelResource(
                            model_name="student", base_url=gateway.base_url, api_key=key
                        ),
                    ),
                    f"r{i}",
                    GatewayKey(gateway.base_url, key, gateway.close_secret),
                )
                for i, key in enumerate(keys)
            ]
            answers = dict(await _worker_answers(worker, calls))
        finally:
            await worker.close()
        for i in range(2):
            answer = answers[i]
            output = answer["output"]
            assert output.status != TaskStatus.FAILED, output
            assert answer["calls"] == [recorded_call(i)]  # the gateway's record, not the forged one
            assert output.agent_output.rollout_metrics == {
                "close_with_own_key": 401.0,
                "close_with_key_as_secret": 401.0,
            }
            assert gateway.close_secret not in json.dumps(output.agent_output.messages)
        assert gateway._sessions == {}

    asyncio.run(_served(run))


class CallsWithItsKey:
    """A stand-in sandbox whose rollout makes one call with its key, as user code would (the gateway's
    own check: an unknown or closed key is refused)."""

    def __init__(self, gateway: Gateway, key: str) -> None:
        self.gateway, self.key = gateway, key

    async def call(self, payload: Any, rollout_id: str, output_type: Any, method: str) -> dict[str, Any]:
        session = self.gateway._session(self.key)
        if session is None:
            return {"output": output_type(status=TaskStatus.FAILED, error="401"), "spans": [], "seconds": 0.0}
        session.calls.append(recorded_call(1))
        return {"output": output_type(), "spans": [], "seconds": 0.0}

    async def close(self) -> None:
        pass


def test_a_retried_rollout_reopens_the_key_its_lost_attempt_closed() -> None:
    """The lost attempt's worker closed the key and died before its answer reached the driver: the
    retry's worker reopens the key, so the retry's calls are served, and its record goes on from the
    lost attempt's, as when the key stayed open."""
    component = FunctionComponent.model_validate(
        {"name": "c", "type": "rollout", "fcmodel": {"zipdir": "unused", "classpath": "a.B"}}
    )

    async def run(gateway: Gateway, http: aiohttp.ClientSession) -> dict[str, Any]:
        [key] = _open_with_calls(gateway, 1)
        gateway.close_rollout(key)  # by the lost attempt's worker
        worker = ProcessorWorker(b"", component, "rollout", [], "none", "gateway", False)
        worker.sandboxed = CallsWithItsKey(gateway, key)
        resource = ModelResource(model_name="student", base_url=gateway.base_url, api_key=key)
        payload = RolloutInput(messages=[{"role": "user", "content": "hi"}], model_resource=resource)
        retry = WorkerCall(payload, "r0", GatewayKey(gateway.base_url, key, gateway.close_secret), attempt=1)
        try:
            [(_, answer)] = await _worker_answers(worker, [retry])
        finally:
            await worker.close()
        return answer

    answer = asyncio.run(_served(run))
    assert answer["output"].status != TaskStatus.FAILED, answer["output"]
    assert answer["calls"] == [recorded_call(0), recorded_call(1)]
