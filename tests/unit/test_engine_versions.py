"""A completion's recorded weight version is the one it was sampled with, when updates come while
rollouts run (`max_staleness >= 2`): an update waits for the sampling requests admitted before it and
admits none until the new weights are in (`Engine._versioned`, `Engine.update_weights`).

A plain `Engine` with a stand-in for vLLM's engine (pause, resume, cache reset) and for the weight
transport; the real path runs in tests/integration/test_staleness.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from opd_trainer.engine import adapters, vllm_engine
from opd_trainer.engine.vllm_engine import Engine, EngineConfig

WEIGHTS = SimpleNamespace(kind="shm")  # a handoff of the whole weights (its transport is stood in for)
ADAPTER = SimpleNamespace(kind="adapter", version=1)  # a LoRA job's adapter handoff


class PausableLLM:
    errored = False

    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def pause_generation(self, *, mode: str = "wait", clear_cache: bool = True) -> None:
        self.log.append("pause")

    async def resume_generation(self) -> None:
        self.log.append("resume")

    async def reset_prefix_cache(self) -> bool:
        return True


def test_an_update_waits_for_admitted_samples_and_later_ones_see_the_new_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log: list[str] = []

    async def apply(handoff: Any, llm: Any, name: str) -> None:
        log.append("weights")

    monkeypatch.setattr(vllm_engine, "apply_weights", apply)

    async def scenario() -> None:
        engine = Engine(EngineConfig(model="unused"), "student-0")
        engine._llm = PausableLLM(log)  # type: ignore[assignment]
        finish_first = asyncio.Event()
        versions: dict[str, int] = {}

        async def sample(name: str, until: asyncio.Event | None = None) -> None:
            async with engine._versioned() as version:
                versions[name] = version
                log.append(f"{name} sampling")
                if until is not None:
                    await until.wait()
                log.append(f"{name} done")

        first = asyncio.create_task(sample("first", finish_first))
        await asyncio.sleep(0)
        update = asyncio.create_task(engine.update_weights(WEIGHTS, 1))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        second = asyncio.create_task(sample("second"))  # arrives while the update waits
        for _ in range(5):
            await asyncio.sleep(0)
        assert log == ["first sampling"]  # the update waits for the first; the second is not admitted
        finish_first.set()
        assert await update == 1
        await asyncio.gather(first, second)
        assert log == [
            "first sampling",
            "first done",
            "pause",
            "weights",
            "resume",
            "second sampling",
            "second done",
        ]
        assert versions == {"first": 0, "second": 1}

    asyncio.run(scenario())


def test_a_failed_update_admits_sampling_again_under_the_old_version(monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(handoff: Any, llm: Any, name: str) -> None:
        raise RuntimeError("transport lost")

    monkeypatch.setattr(vllm_engine, "apply_weights", broken)

    async def scenario() -> int:
        engine = Engine(EngineConfig(model="unused"), "student-0")
        engine._llm = PausableLLM([])  # type: ignore[assignment]
        with pytest.raises(vllm_engine.WeightSyncError, match="transport lost"):
            await engine.update_weights(WEIGHTS, 1)  # type: ignore[arg-type]
        async with engine._versioned() as version:
            return version

    assert asyncio.run(asyncio.wait_for(scenario(), 5)) == 0


def test_an_adapter_update_waits_for_sampling_only_and_keeps_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A LoRA job's update swaps the adapter sampling uses: admitted samples finish first and none is
    admitted meanwhile, but generation is not paused (scoring is the base model's, unchanged) and the
    prefix cache is kept (the base weights did not change)."""
    log: list[str] = []

    async def swap(self: Any, llm: Any, handoff: Any, client: str | None = None) -> None:
        log.append(f"adapter v{handoff.version}")

    monkeypatch.setattr(adapters.ServedAdapters, "swap", swap)

    class NoPauseLLM(PausableLLM):
        async def reset_prefix_cache(self) -> bool:
            log.append("cache reset")
            return True

    async def scenario() -> None:
        engine = Engine(EngineConfig(model="unused", lora_rank=8), "student-0")
        engine._llm = NoPauseLLM(log)  # type: ignore[assignment]
        finish = asyncio.Event()

        async def sample() -> int:
            async with engine._versioned() as version:
                log.append("sampling")
                await finish.wait()
                return version

        first = asyncio.create_task(sample())
        await asyncio.sleep(0)
        update = asyncio.create_task(engine.update_weights(ADAPTER, 1))  # type: ignore[arg-type]
        for _ in range(5):
            await asyncio.sleep(0)
        assert log == ["sampling"]  # waiting for the admitted sample
        finish.set()
        assert await update == 1 and await first == 0
        assert log == ["sampling", "adapter v1"]  # no pause, no resume, no cache reset

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_an_adapter_cannot_reach_an_engine_without_lora() -> None:
    async def scenario() -> None:
        engine = Engine(EngineConfig(model="unused"), "student-0")
        engine._llm = PausableLLM([])  # type: ignore[assignment]
        with pytest.raises(vllm_engine.WeightSyncError, match="started without LoRA"):
            await engine.update_weights(ADAPTER, 1)  # type: ignore[arg-type]

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_on_a_shared_student_one_jobs_adapter_update_holds_only_its_own_sampling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two jobs on one engine serving adapters (`client` a, b): a's update waits for a's admitted
    sample only, b samples meanwhile under its own version, and each records its own adapter's
    version; on a full-weight engine the version is the engine's, whoever asks."""
    log: list[str] = []

    async def swap(self: Any, llm: Any, handoff: Any, client: str | None = None) -> None:
        log.append(f"{client} adapter v{handoff.version}")

    monkeypatch.setattr(adapters.ServedAdapters, "swap", swap)

    async def scenario() -> None:
        engine = Engine(EngineConfig(model="unused", lora_rank=8, max_loras=3), "student-0")
        engine._llm = PausableLLM(log)  # type: ignore[assignment]
        assert await engine.update_weights(SimpleNamespace(kind="adapter", version=4), 4, "b") == 4  # type: ignore[arg-type]
        finish_a = asyncio.Event()

        async def sample(client: str, until: asyncio.Event | None = None) -> int:
            async with engine._versioned(client) as version:
                log.append(f"{client} sampling v{version}")
                if until is not None:
                    await until.wait()
                return version

        first_a = asyncio.create_task(sample("a", finish_a))
        await asyncio.sleep(0)
        update_a = asyncio.create_task(engine.update_weights(ADAPTER, 1, "a"))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        later_a = asyncio.create_task(sample("a"))  # waits for a's update
        assert await asyncio.wait_for(sample("b"), 1) == 4  # not held by a's update
        assert not update_a.done() and not later_a.done()
        finish_a.set()
        assert await update_a == 1 and await first_a == 0 and await later_a == 1
        assert log == [
            "b adapter v4",
            "a sampling v0",
            "b sampling v4",
            "a adapter v1",
            "a sampling v1",
        ]
        assert engine.weight_version("a") == 1 and engine.weight_version("b") == 4
        assert engine.weight_version() == 0  # the engine's own job has no adapter yet

        full = Engine(EngineConfig(model="unused"), "student-1")
        async with full._versioned("a") as version_a, full._versioned("b") as version_b:
            assert version_a == version_b == 0
        assert full._version_gate("a") is full._version_gate(None)  # one gate: new weights change all

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_dropping_a_jobs_adapter_waits_for_its_samples_and_forgets_its_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dropped: list[str | None] = []

    async def swap(self: Any, llm: Any, handoff: Any, client: str | None = None) -> None:
        return None

    async def drop(self: Any, llm: Any, client: str | None = None) -> None:
        dropped.append(client)

    monkeypatch.setattr(adapters.ServedAdapters, "swap", swap)
    monkeypatch.setattr(adapters.ServedAdapters, "drop", drop)

    async def scenario() -> None:
        engine = Engine(EngineConfig(model="unused", lora_rank=8), "student-0")
        engine._llm = PausableLLM([])  # type: ignore[assignment]
        await engine.update_weights(ADAPTER, 3, "a")  # type: ignore[arg-type]
        finish = asyncio.Event()

        async def sample() -> None:
            async with engine._versioned("a"):
                await finish.wait()

        running = asyncio.create_task(sample())
        await asyncio.sleep(0)
        drop_task = asyncio.create_task(engine.drop_adapter("a"))
        for _ in range(5):
            await asyncio.sleep(0)
        assert dropped == []  # a's admitted sample still runs with its adapter
        finish.set()
        await asyncio.gather(running, drop_task)
        assert dropped == ["a"] and engine.weight_version("a") == 0

    asyncio.run(asyncio.wait_for(scenario(), 5))
