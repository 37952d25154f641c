"""A job's gateways hosted in its student engine's process (`rollout/gateway_placement.py` through the
engine's generic hook, `Engine.host`): the gateway samples on that engine in-process (no Ray) and on the
other replicas by Ray, the host is reached by its service name, and the engine's shutdown stops the
gateways before vLLM. No vLLM engine starts here: hosting needs none, and the engine's `sample` is
stood in for."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from chatml_tokenizer import save_chatml_tokenizer
from vllm.logprobs import Logprob

from opd_trainer.engine import vllm_engine
from opd_trainer.engine.vllm_engine import Engine, EngineConfig, Sampled
from opd_trainer.records import LLMCall
from opd_trainer.rollout import gateway_host
from opd_trainer.rollout.chat_requests import chat_request
from opd_trainer.rollout.gateway import RolloutKeyRequest
from opd_trainer.rollout.gateway_host import GatewayRef, LocalReplica, RayReplica
from opd_trainer.rollout.gateway_placement import GATEWAYS_SERVICE, host_in_engine

WORDS = ["[UNK]", "<|im_start|>", "<|im_end|>", "user", "assistant", "hello", "world"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HERE = "a1" * 8  # the engine actor's id, as Ray's runtime context gives it in the engine's process


class _ActorId:
    def __init__(self, value: str) -> None:
        self.value = value

    def hex(self) -> str:
        return self.value


class _Handle:
    """An engine actor's handle: only its id is read."""

    def __init__(self, actor_id: str) -> None:
        self._actor_id = _ActorId(actor_id)


class _Context:
    def get_actor_id(self) -> str:
        return HERE


class _Caller:
    """`actor.method.remote(...)` on the engine itself, as the driver's Ray calls reach it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.engine, name)

        class Method:
            @staticmethod
            async def remote(*args: Any) -> Any:
                return await method(*args)

        return Method


def test_the_student_engine_hosts_the_gateways_and_samples_for_them_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(EngineConfig(model="unused"), "student-0")
    sampled: list[str | None] = []

    async def sample(prompt_ids: list[int], params: Any, client: str | None = None) -> Sampled:
        sampled.append(client)
        call = LLMCall(list(prompt_ids), [5], [-0.5], text="hello", finish_reason="stop")
        return Sampled(call, [{5: Logprob(-0.5, rank=1, decoded_token="hello")}])

    monkeypatch.setattr(engine, "sample", sample)
    monkeypatch.setattr(gateway_host.ray, "get_runtime_context", _Context)
    tokenizer = str(save_chatml_tokenizer(tmp_path, TEMPLATE, WORDS))
    models = {"student": tokenizer, "teacher": tokenizer}
    options = {"max_tokens": 8, "temperature": 1.0, "max_length": 256}
    actor = _Caller(engine)
    student = GatewayRef(actor, "student", GATEWAYS_SERVICE)

    async def go() -> None:
        await engine.host(GATEWAYS_SERVICE, host_in_engine, models, options)
        here, other = _Handle(HERE), _Handle("b2" * 8)
        await student.call("set_engines", "student", [here, other], None)
        host = engine._hosted._services[GATEWAYS_SERVICE]
        gateway = host._gateway("student")
        assert gateway.engines == [LocalReplica(engine), RayReplica(other)]  # type: ignore[comparison-overlap]
        [key] = await student.open_rollouts([RolloutKeyRequest("r1")])
        request = chat_request({"messages": [{"role": "user", "content": "hello world"}]})
        _, call = await gateway.complete(key, request)  # the least-loaded replica: this engine
        assert call.completion_token_ids == [5] and sampled == [None]

    asyncio.run(go())
    # Metered once: the gateways' CPU is in the engine's process usage.
    monkeypatch.setattr(vllm_engine, "actor_usage", lambda: {"cpu_s": 7.0, "gpus": 0.0})
    assert asyncio.run(engine.usage())["cpu_s"] == 7.0
    stopped: list[str] = []
    host = engine._hosted._services[GATEWAYS_SERVICE]
    for name in ("student", "teacher"):
        hosted_gateway = host._gateway(name)
        real_shutdown = hosted_gateway.shutdown

        async def shutdown(name: str = name, real: Any = real_shutdown) -> None:
            stopped.append(name)
            await real()

        hosted_gateway.shutdown = shutdown  # type: ignore[method-assign]
    asyncio.run(engine.shutdown())
    assert stopped == ["student", "teacher"] and engine._hosted._services == {}
