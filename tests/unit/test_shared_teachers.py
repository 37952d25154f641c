"""Sharing one teacher engine between jobs: fair admission, per-job counts, and which configs share.
(The registry with real engines and two real jobs: tests/integration/test_shared_teacher.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from opd_trainer.engine.fair_gate import FairGate
from opd_trainer.engine.shared_teachers import sharing_key
from opd_trainer.engine.teacher_sharing import LoadStreak
from opd_trainer.engine.vllm_engine import ClientShare, EngineConfig


async def _requests(gate: FairGate, client: str, count: int, order: list[str], seconds: float) -> None:
    async def one() -> None:
        async with gate.slot(client):
            order.append(client)
            await asyncio.sleep(seconds)

    await asyncio.gather(*(one() for _ in range(count)))


def test_a_burst_does_not_starve_a_later_client() -> None:
    """Job A queues 20 requests on a 2-slot engine; job B's 4 arrive after. B's are admitted in turn
    with A's remaining ones, not after all of A's."""
    order: list[str] = []

    async def go() -> FairGate:
        gate = FairGate(2)
        burst = asyncio.create_task(_requests(gate, "a", 20, order, 0.01))
        await asyncio.sleep(0.005)  # A holds both slots and has 18 waiting
        await asyncio.gather(burst, _requests(gate, "b", 4, order, 0.01))
        return gate

    gate = asyncio.run(go())
    last_b = max(i for i, client in enumerate(order) if client == "b")
    assert last_b < 12, order  # strictly alternating after A's first two: B is done by position ~10
    assert gate.admitted == {"a": 20, "b": 4} and gate.in_flight == 0 and gate.queued == 0


def test_capacity_is_never_exceeded_and_a_lone_client_gets_it_all() -> None:
    peak = 0

    async def go() -> None:
        nonlocal peak
        gate = FairGate(3)

        async def one() -> None:
            nonlocal peak
            async with gate.slot("a"):
                peak = max(peak, gate.in_flight)
                await asyncio.sleep(0.01)

        await asyncio.gather(*(one() for _ in range(10)))

    asyncio.run(go())
    assert peak == 3


def test_a_cancelled_waiter_gives_its_turn_away() -> None:
    async def go() -> FairGate:
        gate = FairGate(1)
        held = asyncio.Event()
        release = asyncio.Event()

        async def holder() -> None:
            async with gate.slot("a"):
                held.set()
                await release.wait()

        async def waiter(client: str) -> None:
            async with gate.slot(client):
                await asyncio.sleep(0)

        first = asyncio.create_task(holder())
        await held.wait()
        cancelled = asyncio.create_task(waiter("b"))
        served = asyncio.create_task(waiter("c"))
        await asyncio.sleep(0)
        cancelled.cancel()
        release.set()
        await asyncio.gather(first, served)
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        return gate

    gate = asyncio.run(go())
    assert gate.in_flight == 0 and gate.admitted == {"a": 1, "c": 1}


def test_a_jobs_share_counts_its_own_requests() -> None:
    share = ClientShare()
    share.count(sequence_tokens=100, cached=60, rescored=False)
    share.count(sequence_tokens=50, cached=49, rescored=True)  # ran twice, the second without the cache
    assert share.totals["prompt_tokens"] == 200 and share.totals["prefix_cache_hits"] == 109
    assert share.totals["requests_finished"] == 3 and share.totals["scores_rescored"] == 1
    assert share.take_interval() == 200 and share.take_interval() == 0


def test_engines_are_shared_only_when_they_would_be_the_same(tmp_path: Path) -> None:
    (tmp_path / "teacher").mkdir()
    base = EngineConfig(model=str(tmp_path / "teacher"), max_model_len=512, role="teacher", max_logprobs=20)
    key = sharing_key(base)
    # The per-job seed, batch concurrency and placement timeout do not change the engines.
    same = base.model_copy(update={"seed": 7, "concurrent_sequences": 3, "placement_timeout_s": 5.0})
    assert sharing_key(same) == key
    # The same folder by another spelling is the same weights.
    assert sharing_key(base.model_copy(update={"model": str(tmp_path / "." / "teacher")})) == key
    for change in ({"max_model_len": 1024}, {"max_logprobs": 32}, {"model": str(tmp_path)}):
        assert sharing_key(base.model_copy(update=change)) != key, change


def _load(in_flight: float, queued: float) -> dict[str, float]:
    return {"in_flight": in_flight, "queued": queued, "capacity": 2.0}


def test_a_group_grows_after_two_busy_checks_and_shrinks_after_five_idle_ones() -> None:
    streak = LoadStreak()
    assert streak.scale([_load(2, 3)], replicas=1, low=1, high=2) == 0
    assert streak.scale([_load(2, 1)], replicas=1, low=1, high=2) == 1  # two checks with requests waiting
    assert streak.scale([_load(2, 5), _load(2, 5)], replicas=2, low=1, high=2) == 0  # at the most
    # Busy but nothing waiting is not a reason to grow, nor to shrink.
    assert [streak.scale([_load(1, 0), _load(0, 0)], replicas=2, low=1, high=3) for _ in range(6)] == [0] * 6
    idle = [streak.scale([_load(0, 0), _load(0, 0)], replicas=2, low=1, high=2) for _ in range(5)]
    assert idle == [0, 0, 0, 0, -1]
    assert [streak.scale([_load(0, 0)], replicas=1, low=1, high=2) for _ in range(6)] == [0] * 6  # the floor
