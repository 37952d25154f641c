"""A gateway in front of engines shared with other jobs names its job on every sampling call (the
job's own LoRA adapter, fair admission, its own counts: `engine/shared_engines.py`), streamed or not.
Stand-in engine actors record what they were asked; the real path runs in
tests/integration/test_shared_student.py."""

from __future__ import annotations

import asyncio
from typing import Any

from chatml_tokenizer import save_chatml_tokenizer
from vllm.logprobs import Logprob

from opd_trainer.engine.vllm_engine import Sampled
from opd_trainer.records import LLMCall
from opd_trainer.rollout.chat_requests import chat_request
from opd_trainer.rollout.gateway import Gateway
from opd_trainer.rollout.gateway_host import GatewayHost, RayReplica

WORDS = ["[UNK]", "<|im_start|>", "<|im_end|>", "user", "assistant", "hello", "world"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class _Method:
    def __init__(self, engine: _Engine, name: str) -> None:
        self.engine, self.name = engine, name

    def options(self, **options: Any) -> _Method:
        return self

    def remote(self, prompt_ids: list[int], params: Any, client: str | None = None) -> Any:
        self.engine.asked.append((self.name, client))
        call = LLMCall(list(prompt_ids), [5], [-0.5], text="hello", finish_reason="stop")
        sampled = Sampled(call, [{5: Logprob(-0.5, rank=1, decoded_token="hello")}])
        if self.name == "sample":
            return _done(sampled)
        return _pieces([sampled])


async def _done(value: Any) -> Any:
    return value


async def _pieces(values: list[Any]) -> Any:
    for value in values:
        yield _done(value)


class _Engine:
    """A stand-in engine actor: `sample` / `sample_stream` record the client they were asked for."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str | None]] = []

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)


def test_every_sampling_call_names_the_job_on_shared_engines(tmp_path: Any) -> None:
    folder = save_chatml_tokenizer(tmp_path, TEMPLATE, WORDS)
    engine = _Engine()
    host = GatewayHost({"student": str(folder)}, max_tokens=8, temperature=1.0, max_length=256)
    gateway: Gateway = host._gateway("student")

    async def go() -> None:
        await host.set_engines("student", [engine], "job-a")  # type: ignore[list-item]
        key = gateway.open_rollout("r1")
        request = chat_request({"messages": [{"role": "user", "content": "hello world"}]})
        _, call = await gateway.complete(key, request)
        assert call.completion_token_ids == [5]
        prepared = await gateway._prepare(key, request)
        chunks = [chunk async for chunk in gateway.stream(prepared, include_usage=False)]
        assert chunks[-1] == "data: [DONE]\n\n"
        gateway.set_engines([RayReplica(engine)])  # type: ignore[arg-type]  # a job's own engines: no client
        await gateway.complete(key, request)

    asyncio.run(go())
    assert engine.asked == [("sample", "job-a"), ("sample_stream", "job-a"), ("sample", None)]
