"""Sharing engines between jobs: fair admission, per-job counts, which configs share, and how the
registry groups LoRA jobs on student engines. (The registry with real engines and two real jobs:
tests/integration/test_shared_teacher.py; two adapters on one real shared student:
tests/integration/test_shared_student.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from opd_trainer.engine import fleet
from opd_trainer.engine.engine_sharing import EngineSharing, LoadStreak
from opd_trainer.engine.fair_gate import FairGate
from opd_trainer.engine.shared_engines import SharedEngines, shared_config, sharing_key
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


def test_lora_students_share_when_vllm_serves_their_ranks_alike(tmp_path: Path) -> None:
    """Ranks 4 and 8 are both served at vLLM's max_lora_rank 8; 16 is not; a student with no LoRA
    (full training, never shared) keys apart from every LoRA one."""
    (tmp_path / "student").mkdir()
    base = EngineConfig(model=str(tmp_path / "student"), max_model_len=512, lora_rank=4)
    assert sharing_key(base.model_copy(update={"lora_rank": 8})) == sharing_key(base)
    assert sharing_key(base.model_copy(update={"lora_rank": 16})) != sharing_key(base)
    assert sharing_key(base.model_copy(update={"lora_rank": None})) != sharing_key(base)
    served = shared_config(base, EngineSharing(idle_s=0, max_jobs=3))
    assert (served.lora_rank, served.max_loras) == (8, 4)  # one adapter per job, one more for a swap
    teacher = EngineConfig(model=str(tmp_path / "student"), role="teacher")
    assert shared_config(teacher, EngineSharing(idle_s=0, max_jobs=3)) == teacher


def test_a_sampling_clients_share_counts_its_prompts_and_generated_tokens() -> None:
    share = ClientShare()
    share.count_sample(prompt_tokens=30, generated_tokens=12, cached=16)
    share.count_sample(prompt_tokens=30, generated_tokens=8, cached=30)
    totals = share.totals
    assert (totals["prompt_tokens"], totals["generation_tokens"], totals["prefix_cache_hits"]) == (60, 20, 46)
    assert totals["requests_finished"] == 2 and share.take_interval() == 80 and share.take_interval() == 0


class _Remote:
    def __init__(self, replica: _Replica, method: str) -> None:
        self.replica, self.method = replica, method

    async def remote(self, *args: Any) -> None:
        if self.method == "__ray_ready__":  # Ray's liveness call: not one of the engine's methods
            if self.replica.dead:
                raise ActorDiedError()
            return
        self.replica.calls.append((self.replica.name, self.method, args))


class _Replica:
    """A stand-in engine actor: records the calls made on it; `dead` as Ray would say."""

    def __init__(self, name: str, calls: list[tuple[str, str, Any]]) -> None:
        self.name, self.calls, self.dead = name, calls, False

    def __getattr__(self, method: str) -> _Remote:
        return _Remote(self, method)


def test_a_group_with_a_dead_replica_is_never_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job recovering from its shared teacher's loss acquires again: it gets a new group, and the
    broken group's live replicas are shut down."""
    calls: list[tuple[str, str, Any]] = []
    started: list[_Replica] = []

    async def start(config: EngineConfig, role: str) -> tuple[list[Any], list[str]]:
        started.extend(
            [_Replica(f"{role}-{len(started)}-a", calls), _Replica(f"{role}-{len(started)}-b", calls)]
        )
        return started[-2:], ["node", "node"]

    monkeypatch.setattr(fleet.ray, "kill", lambda actor: calls.append((actor.name, "kill", ())))
    config = EngineConfig(model="/models/teacher")

    async def scenario() -> None:
        sharing = EngineSharing(idle_s=3600, check_s=3600)
        registry = SharedEngines(sharing, "teacher", start=start, stop=fleet.stop_replicas)
        first = await registry.acquire("a", config, None)
        assert (await registry.acquire("b", config, None))[0] == first[0]  # alive: shared
        started[0].dead = True
        again = await registry.acquire("a", config, None)
        assert again[0] != first[0] and again[1] == started[2:]
        assert list(registry.groups) == [again[0]]

    asyncio.run(scenario())
    assert ("teacher-0-b", "shutdown", ()) in calls and ("teacher-0-b", "kill", ()) in calls


def test_lora_jobs_fill_a_student_group_then_start_another_and_release_unloads_their_adapter(
    tmp_path: Path,
) -> None:
    calls: list[tuple[str, str, Any]] = []
    configs: list[EngineConfig] = []

    async def start(config: EngineConfig, role: str) -> tuple[list[Any], list[str]]:
        configs.append(config)
        return [_Replica(f"{role}-{len(configs)}", calls)], ["node"]

    (tmp_path / "student").mkdir()
    config = EngineConfig(model=str(tmp_path / "student"), lora_rank=8)

    async def scenario() -> dict[str, Any]:
        sharing = EngineSharing(idle_s=3600, max_jobs=2, check_s=3600)
        registry = SharedEngines(sharing, "student", start=start, stop=fleet.stop_replicas)
        a, b, c = [await registry.acquire(job, config, None) for job in ("a", "b", "c")]
        assert a[0] == b[0] != c[0]  # two jobs per group: the third starts another
        assert (await registry.acquire("a", config, None))[0] == a[0]  # a holder acquiring again stays
        await registry.release("a")
        assert calls == [("student-1", "drop_adapter", ("a",))]  # only a's group, only a's adapter
        return await registry.state()

    state = asyncio.run(scenario())
    assert [(g["holders"], g["replicas"]) for g in state["groups"]] == [(["b"], 1), (["c"], 1)]
    assert [(c.lora_rank, c.max_loras) for c in configs] == [(8, 3), (8, 3)]
