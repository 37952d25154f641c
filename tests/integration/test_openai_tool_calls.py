"""The tiny teacher served by vLLM's own OpenAI server with the hermes parser returns structured tool calls.

This proves the tokenizer's `<tool_call>` markup and chat template are what vLLM's `hermes` tool
parser expects, end to end through real HTTP and the official `openai` client, and that the recording
gateway (which uses the same parser registry, `tool_call_parser`) answers the same requests the same.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from openai import OpenAI
from transformers import AutoTokenizer

from opd_trainer.cluster.ports import free_port
from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.demo.tiny_models.serving import TINY_KV_CACHE_BYTES
from opd_trainer.demo.tool_routing import evaluator
from opd_trainer.errors import ConfigError
from opd_trainer.jsonl import read_jsonl
from opd_trainer.rollout.gateway import GatewayActor
from opd_trainer.rollout.gateway_host import RayReplica

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def teacher_server(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    max_len = json.loads((tiny_models.teacher / "config.json").read_text())["max_position_embeddings"]
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tiny_models.teacher),
        "--served-model-name",
        "teacher",
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_len),
        "--kv-cache-memory-bytes",
        str(TINY_KV_CACHE_BYTES),
        "--enforce-eager",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with log_path.open("w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base_url, server, log_path)
        yield f"{base_url}/v1"
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def _wait_healthy(base_url: str, server: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vLLM server exited:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"vLLM server not healthy in time:\n{log_path.read_text()[-3000:]}")


def test_teacher_tool_calls_come_back_structured(teacher_server: str, tiny_models: TinyModels) -> None:
    """Whatever tool calls the teacher writes, the chat endpoint returns as structured `tool_calls`.

    The raw greedy text of the same prompt (completions endpoint, our own template rendering) is the
    reference, so the check does not depend on how accurate the teacher is on these records.
    """
    records = [
        r
        for r in read_jsonl(tiny_models.data_dir / "validation.jsonl")
        if r["rollout_extra"]["category"] == "tool_call"
    ][:8]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models.teacher))
    client = OpenAI(base_url=teacher_server, api_key="unused")
    with_calls = 0
    for record in records:
        prompt = tokenizer.apply_chat_template(
            record["messages"], tools=record["tools"], add_generation_prompt=True, tokenize=False
        )
        raw = client.completions.create(
            model="teacher",
            prompt=prompt,
            temperature=0.0,
            max_tokens=64,
            extra_body={"skip_special_tokens": False},
        )
        expected = evaluator.parse_reply(raw.choices[0].text.split("<|im_end|>")[0])
        response = client.chat.completions.create(
            model="teacher",
            messages=record["messages"],
            tools=record["tools"],
            temperature=0.0,
            max_tokens=64,
        )
        message = response.choices[0].message
        got = [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls or []]
        assert got == [(call.name, call.arguments) for call in expected.tool_calls], raw.choices[0].text
        if got:
            with_calls += 1
            assert response.choices[0].finish_reason == "tool_calls"
            assert not (message.content or "").strip()
    # The teacher calls a tool on most of these records (6 of 8 measured): the check is not vacuous.
    assert with_calls >= len(records) // 2, f"only {with_calls}/{len(records)} replies called a tool"


def test_chat_endpoint_returns_token_ids(teacher_server: str, tiny_models: TinyModels) -> None:
    record = read_jsonl(tiny_models.data_dir / "validation.jsonl")[0]
    client = OpenAI(base_url=teacher_server, api_key="unused")
    response = client.chat.completions.create(
        model="teacher",
        messages=record["messages"],
        tools=record["tools"],
        max_tokens=32,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    choice = response.choices[0]
    token_ids = choice.model_extra["token_ids"]
    assert token_ids and len(choice.logprobs.content) == len(token_ids)
    assert response.model_extra["prompt_token_ids"]


def test_the_gateway_answers_tool_calls_as_vllms_own_server(
    teacher_server: str, teacher_engine: Any, tiny_models: TinyModels
) -> None:
    """The gateway parses with vLLM's hermes parser: the same greedy request gets the same message
    (content, tool calls, finish reason) from the gateway in front of our engine actor as from
    `vllm serve --tool-call-parser hermes` on the same weights, under `tool_choice` auto, required
    and named (the last two constrain sampling the same way)."""
    records = [
        r
        for r in read_jsonl(tiny_models.data_dir / "validation.jsonl")
        if r["rollout_extra"]["category"] == "tool_call"
    ][:6]
    gateway = GatewayActor.remote(  # type: ignore[attr-defined]
        "teacher",
        str(tiny_models.teacher),
        [RayReplica(teacher_engine)],
        max_tokens=64,
        temperature=1.0,
        max_length=1024,
    )
    base_url = ray.get(gateway.serve.remote())
    ray.get(gateway.ready.remote())
    try:
        key = ray.get(gateway.open_rollout.remote("greedy", temperature=0.0))
        ours = OpenAI(base_url=base_url, api_key=key)
        theirs = OpenAI(base_url=teacher_server, api_key="unused")
        with_calls = 0
        forced = [
            {"tool_choice": "required"},
            {
                "tool_choice": {
                    "type": "function",
                    "function": {"name": records[0]["tools"][-1]["function"]["name"]},
                }
            },
        ]
        requests = [{"messages": r["messages"], "tools": r["tools"], "max_tokens": 64} for r in records]
        requests += [{**request, **choice} for request in requests[:2] for choice in forced]
        for request in requests:
            want = theirs.chat.completions.create(model="teacher", temperature=0.0, **request).choices[0]
            got = ours.chat.completions.create(model="teacher", **request).choices[0]
            assert (got.message.content or None) == (want.message.content or None)
            assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls or []] == [
                (c.function.name, c.function.arguments) for c in want.message.tool_calls or []
            ]
            assert got.finish_reason == want.finish_reason
            with_calls += bool(want.message.tool_calls)
        assert with_calls >= len(requests) // 2, f"only {with_calls}/{len(requests)} replies called a tool"
    finally:
        ray.get(gateway.shutdown.remote())
        ray.kill(gateway)


def test_an_unknown_or_unfitting_tool_call_parser_fails_naming_the_field(
    ray_session: None, tiny_models: TinyModels
) -> None:
    for name, says in (
        ("no-such-parser", "unknown tool-call parser 'no-such-parser'"),
        ("llama3_json", "does not fit"),
    ):
        gateway = GatewayActor.remote(  # type: ignore[attr-defined]
            "teacher",
            str(tiny_models.teacher),
            [],
            max_tokens=8,
            temperature=1.0,
            max_length=64,
            tool_call_parser=name,
        )
        try:
            ray.get(gateway.serve.remote())
            with pytest.raises(ConfigError) as error:
                ray.get(gateway.ready.remote())
            assert error.value.field == "tool_call_parser" and says in error.value.message
        finally:
            ray.get(gateway.shutdown.remote())
            ray.kill(gateway)


def _holds(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_a_multi_turn_trajectory_trains_its_tool_calls_and_never_the_tool_output(
    teacher_engine: Any, tiny_models: TinyModels
) -> None:
    """Two turns through the recording gateway (a tool call, its result, the answer), then the
    learner's loss mask of the recorded calls, token by token: every token the model wrote (the call's
    `<tool_call>` markup included) is trained, every other token (the prompt, the tool output) is not."""
    import torch

    from opd_trainer.learner.batch import pad_segments

    records = [
        r
        for r in read_jsonl(tiny_models.data_dir / "validation.jsonl")
        if r["rollout_extra"]["category"] == "tool_call"
    ]
    gateway = GatewayActor.remote(  # type: ignore[attr-defined]
        "teacher",
        str(tiny_models.teacher),
        [RayReplica(teacher_engine)],
        max_tokens=64,
        temperature=1.0,
        max_length=1024,
    )
    base_url = ray.get(gateway.serve.remote())
    ray.get(gateway.ready.remote())
    try:
        for record in records[:8]:  # the first the teacher answers with a call (6 of 8 do, greedy)
            key = ray.get(gateway.open_rollout.remote(f"two-turns-{id(record)}", temperature=0.0))
            client = OpenAI(base_url=base_url, api_key=key)
            first = (
                client.chat.completions.create(
                    model="teacher", messages=record["messages"], tools=record["tools"]
                )
                .choices[0]
                .message
            )
            if first.tool_calls:
                break
            ray.get(gateway.close_rollout.remote(key))
        call = first.tool_calls[0]
        tool_output = '{"status": "shipped", "eta_days": 3}'
        history = [
            *record["messages"],
            first.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": tool_output},
        ]
        client.chat.completions.create(model="teacher", messages=history, tools=record["tools"])
        calls = ray.get(gateway.close_rollout.remote(key))
    finally:
        ray.get(gateway.shutdown.remote())
        ray.kill(gateway)
    assert len(calls) == 2
    segments = [dataclasses.replace(c, teacher_logprobs=c.sampler_logprobs) for c in calls]
    batch = pad_segments(segments, 0, torch.device("cpu"))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models.teacher))
    # Its inner tokens: at its edges the template's own text may merge with it differently.
    output_ids = tokenizer.encode(tool_output, add_special_tokens=False)[1:-1]
    for row, segment in enumerate(segments):
        targets = batch.targets_B_T[row].tolist()
        trained = batch.mask_B_T[row].bool().tolist()
        assert [t for t, m in zip(targets, trained, strict=True) if m] == segment.completion_token_ids
        assert not _holds([t for t, m in zip(targets, trained, strict=True) if m], output_ids)
    # The first turn's completion is the call, markup and all; the second turn sees the tool's output
    # only as context.
    assert "<tool_call>" in tokenizer.decode(segments[0].completion_token_ids, skip_special_tokens=False)
    assert _holds(segments[1].prompt_token_ids, output_ids)
