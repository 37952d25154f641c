"""`InprocAsyncLLM`'s own logic over a fake engine: outputs reach their request's reader in order, a
reader that stops early aborts its request, a pause waits for requests in flight and holds new ones,
a failing step fails every reader instead of hanging it, and a failed build leaves no thread behind.
(The real engine under it: the integration tests' engines all run this way on CPU.)"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

import pytest

from opd_trainer.engine.inproc_llm import EngineDeadError, InprocAsyncLLM


@dataclass
class Output:
    request_id: str
    token: int
    finished: bool


class FakeEngine:
    """Each request produces `tokens` outputs, one per step; `fail_at_step` makes a step raise."""

    def __init__(self, tokens: int = 3, fail_at_step: int | None = None) -> None:
        self.tokens = tokens
        self.fail_at_step = fail_at_step
        self.steps = 0
        self.produced: dict[str, int] = {}
        self.aborted: list[str] = []
        self.calls: list[str] = []
        self.gate = threading.Event()  # steps wait for it (tests hold requests in flight)
        self.gate.set()
        self.engine_core = self

    def add_request(self, request_id: str, prompt: Any, params: Any, lora_request: Any = None) -> str:
        self.produced[request_id] = 0
        return request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.produced)

    def step(self) -> list[Output]:
        self.gate.wait(5)
        self.steps += 1
        if self.fail_at_step == self.steps:
            raise RuntimeError("core died")
        outputs = []
        for request_id in list(self.produced):
            self.produced[request_id] += 1
            done = self.produced[request_id] == self.tokens
            outputs.append(Output(request_id, self.produced[request_id], done))
            if done:
                del self.produced[request_id]
        return outputs

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.aborted.append(request_id)
            self.produced.pop(request_id, None)

    def collective_rpc(
        self, method: str, timeout: Any = None, args: Any = (), kwargs: Any = None
    ) -> list[Any]:
        self.calls.append(method)
        return [{"ok": True, "args": args}]

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    def shutdown(self) -> None:
        self.calls.append("shutdown")


async def started(engine: FakeEngine) -> InprocAsyncLLM:
    class OverFake(InprocAsyncLLM):
        def _build(self, args: Any, stat_loggers: list[Any]) -> None:
            self._engine = engine  # type: ignore[assignment]

    return await OverFake.start(None, [])  # type: ignore[arg-type]


async def collect(llm: InprocAsyncLLM, request_id: str) -> list[int]:
    return [output.token async for output in llm.generate({}, None, request_id)]  # type: ignore[arg-type]


def test_each_reader_gets_its_own_outputs_in_order_and_rpcs_run_on_the_engine() -> None:
    async def scenario() -> None:
        engine = FakeEngine(tokens=3)
        llm = await started(engine)
        assert await asyncio.gather(collect(llm, "a"), collect(llm, "b")) == [[1, 2, 3], [1, 2, 3]]
        assert await llm.collective_rpc("reload", args=("/x",)) == [{"ok": True, "args": ("/x",)}]
        assert await llm.reset_prefix_cache() is True
        assert not llm.errored
        llm.shutdown()
        assert engine.calls == ["reload", "reset_prefix_cache", "shutdown"]
        assert llm.errored  # its thread is gone

    asyncio.run(scenario())


def test_a_reader_that_stops_early_aborts_its_request() -> None:
    async def scenario() -> None:
        engine = FakeEngine(tokens=50)
        llm = await started(engine)
        stream = llm.generate({}, None, "early")  # type: ignore[arg-type]
        assert (await anext(stream)).token == 1
        await stream.aclose()
        for _ in range(100):
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == ["early"]
        assert await collect(llm, "next") == list(range(1, 51))  # the engine goes on serving
        llm.shutdown()

    asyncio.run(scenario())


def test_a_pause_waits_for_requests_in_flight_and_holds_new_ones_until_resumed() -> None:
    async def scenario() -> None:
        engine = FakeEngine(tokens=3)
        engine.gate.clear()
        llm = await started(engine)
        in_flight = asyncio.create_task(collect(llm, "first"))
        await asyncio.sleep(0.05)
        pause = asyncio.create_task(llm.pause_generation(mode="wait", clear_cache=True))
        await asyncio.sleep(0.05)
        assert not pause.done()  # "first" has not finished
        held = asyncio.create_task(collect(llm, "held"))
        engine.gate.set()
        assert await in_flight == [1, 2, 3]
        await pause
        assert engine.calls == ["reset_prefix_cache"]
        await asyncio.sleep(0.05)
        assert not held.done() and "held" not in engine.produced
        await llm.resume_generation()
        assert await held == [1, 2, 3]
        llm.shutdown()

    asyncio.run(scenario())


def test_a_failing_step_fails_every_reader_and_later_calls() -> None:
    async def scenario() -> None:
        engine = FakeEngine(tokens=5, fail_at_step=2)
        llm = await started(engine)
        results = await asyncio.gather(collect(llm, "a"), collect(llm, "b"), return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert llm.errored
        with pytest.raises(EngineDeadError):
            await llm.collective_rpc("reload")
        llm.shutdown()
        assert not llm._thread.is_alive()

    asyncio.run(scenario())


def test_an_engine_that_fails_to_build_raises_and_leaves_no_thread() -> None:
    class Unbuildable(InprocAsyncLLM):
        def _build(self, args: Any, stat_loggers: list[Any]) -> None:
            raise ValueError("max_model_len too large")

    async def scenario() -> None:
        threads = threading.active_count()
        with pytest.raises(ValueError, match="max_model_len"):
            await Unbuildable.start(None, [])  # type: ignore[arg-type]
        for _ in range(100):
            if threading.active_count() == threads:
                break
            await asyncio.sleep(0.01)
        assert threading.active_count() == threads

    asyncio.run(scenario())
