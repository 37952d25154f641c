"""How a `WorkerPool` sends calls to its workers: those submitted together go to each worker in one
streaming call (at most `concurrency` in flight on a worker, the rest queued), each answer is settled
as it arrives, and timeouts, retries, kills and cancellation stay per call.

Fake workers stand in for the Ray actors (`ProcessorWorker.calls`: an async generator of answers);
the real ones: tests/integration/test_worker_pools.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import pytest
from ray.exceptions import RayActorError, TaskCancelledError

from opd_trainer.jobspec.job_spec import FunctionComponent
from opd_trainer.sdk import AgentOutput, RolloutOutput, TaskStatus
from opd_trainer.workers import pool as worker_pool
from opd_trainer.workers.pool import ProcessorCall, WorkerCall, WorkerPool

pytestmark = pytest.mark.timeout(60)


class FakeWorker:
    made: list[FakeWorker] = []  # noqa: RUF012  (every fake, for the faked `ray.cancel`)

    """`worker.calls.options(num_returns="streaming").remote(batch)`: each call answers after its
    delay (`delays[rollout_id]`; None: never); `dies_after` seconds into a batch, or when killed
    (`ray.kill`, faked), the worker dies and its stream raises as Ray's does."""

    def __init__(self, name: str, delays: dict[str, float | None], dies_after: float | None = None) -> None:
        self.name, self.delays, self.dies_after = name, delays, dies_after
        self.batches: list[list[str]] = []
        self.killed = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.streams: list[Any] = []
        self.calls = self
        FakeWorker.made.append(self)

    def options(self, **_: Any) -> FakeWorker:
        return self

    def remote(self, batch: list[WorkerCall]) -> AsyncIterator[Awaitable[Any]]:
        self.batches.append([call.rollout_id for call in batch])
        self.streams.append(self._stream(batch))
        return self.streams[-1]

    async def _answer(self, index: int, call: WorkerCall) -> tuple[int, dict[str, Any]]:
        delay = self.delays[call.rollout_id]
        if delay is None:
            await asyncio.Event().wait()
        await asyncio.sleep(delay or 0.0)
        attempt = call.payload  # the test's payload is the attempt id
        output = RolloutOutput(agent_output=AgentOutput(messages=[], rollout_metrics={"attempt": attempt}))
        return index, {"output": output, "spans": [], "seconds": delay, "worker": self.name}

    async def _death(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.killed.wait(), self.dies_after)

    async def _stream(self, batch: list[WorkerCall]) -> AsyncIterator[Awaitable[Any]]:
        pending: set[asyncio.Future[Any]] = {
            asyncio.ensure_future(self._answer(i, call)) for i, call in enumerate(batch)
        }
        death = asyncio.ensure_future(self._death())
        cancel = asyncio.ensure_future(self.cancelled.wait())
        try:
            while pending:
                ends = {death, cancel}
                done, pending = await asyncio.wait(pending | ends, return_when=asyncio.FIRST_COMPLETED)
                if death in done:
                    raise RayActorError()
                if cancel in done:
                    raise TaskCancelledError()
                pending -= ends
                for task in done:
                    yield asyncio.sleep(0, task.result())
        finally:
            for task in [*pending, death, cancel]:
                task.cancel()


class Pool(WorkerPool):
    component_types = ("rollout",)


def _pool(workers: list[FakeWorker], *, concurrency: int = 2, timeout: float = 30.0) -> Pool:
    component = FunctionComponent.model_validate(
        {
            "name": "c",
            "type": "rollout",
            "timeout": timeout,
            "fcmodel": {"zipdir": "unused", "classpath": "a.B"},
            "runtime": {"concurrency": concurrency, "capacity": len(workers), "max_capacity": len(workers)},
        }
    )
    pool = Pool("job", component, Path("unused"))
    for worker in workers:
        pool._workers.append(worker)
        pool._in_flight[worker] = 0
    return pool


def _calls(names: list[str]) -> list[ProcessorCall]:
    return [ProcessorCall(lambda attempt: attempt, name) for name in names]


@pytest.fixture(autouse=True)
def no_ray(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """`ray.kill` and `ray.cancel` recorded instead of sent; replacement workers never start."""
    done: list[Any] = []

    def kill(actor: FakeWorker) -> None:
        done.append(("kill", actor))
        actor.killed.set()

    monkeypatch.setattr(worker_pool.ray, "kill", kill)

    def cancel(stream: Any) -> None:
        done.append(("cancel", stream))
        for worker in FakeWorker.made:
            if stream in worker.streams:
                worker.cancelled.set()

    monkeypatch.setattr(worker_pool.ray, "cancel", cancel)

    async def no_replacement(self: WorkerPool) -> bool:
        return False

    monkeypatch.setattr(WorkerPool, "_add_worker_within_max", no_replacement)
    return done


def test_calls_submitted_together_go_to_each_worker_in_one_batch_and_the_rest_as_slots_free() -> None:
    delays: dict[str, float | None] = {f"r{i}": 0.05 * (i + 1) for i in range(6)}
    a, b = FakeWorker("a", delays), FakeWorker("b", delays)
    pool = _pool([a, b], concurrency=2)
    seen: list[tuple[int, int]] = []

    async def run() -> list[dict[str, Any]]:
        answers = pool.submit(_calls(list(delays)))
        await asyncio.sleep(0)  # the dispatch runs at the end of the submitting turn
        seen.append((sum(pool._in_flight.values()), len(pool._queue)))
        return list(await asyncio.gather(*answers))

    answers = asyncio.run(run())
    assert seen == [(4, 2)]  # concurrency 2 on each of two workers; two calls wait in the pool
    assert a.batches[0] == ["r0", "r2"] and b.batches[0] == ["r1", "r3"]  # least loaded first
    assert sorted(name for batch in a.batches + b.batches for name in batch) == sorted(delays)
    assert all(a["output"].status == TaskStatus.SUCCESS and a["attempt_id"] == 0 for a in answers)
    assert pool.calls == 6 and pool._in_flight == {a: 0, b: 0}


def test_a_worker_that_dies_under_a_batch_has_its_unanswered_calls_retried_elsewhere() -> None:
    delays: dict[str, float | None] = {"r0": 0.01, "r1": 0.01, "r2": 5.0, "r3": 0.01}
    dying = FakeWorker("dying", delays, dies_after=0.3)
    healthy = FakeWorker("healthy", {**delays, "r2": 0.01})
    pool = _pool([dying, healthy], concurrency=2)

    async def run() -> list[dict[str, Any]]:
        return list(await asyncio.gather(*pool.submit(_calls(list(delays)))))

    answers = asyncio.run(run())
    by_name = dict(zip(delays, answers, strict=True))
    assert by_name["r2"]["worker"] == "healthy" and by_name["r2"]["attempt_id"] == 1
    assert by_name["r2"]["output"].agent_output.rollout_metrics == {"attempt": 1.0}
    assert by_name["r0"]["worker"] == "dying" and by_name["r0"]["attempt_id"] == 0  # answered first
    assert pool.retries == 1 and pool.replaced == 1 and pool._workers == [healthy]


def test_a_call_past_its_timeout_fails_and_its_worker_is_killed_with_its_other_calls(
    no_ray: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_pool, "TIMEOUT_GRACE_S", 0.1)
    delays: dict[str, float | None] = {"stuck": None, "waits": None}
    worker = FakeWorker("w", delays)
    pool = _pool([worker], concurrency=2, timeout=0.2)

    async def run() -> list[dict[str, Any]]:
        return list(await asyncio.gather(*pool.submit(_calls(["stuck", "waits"]))))

    stuck, waits = asyncio.run(run())
    assert "timed out after 0.2s" in stuck["output"].error and "restarted" in stuck["output"].error
    assert waits["output"].error == stuck["output"].error  # killed on purpose: failed, not retried
    assert ("kill", worker) in no_ray and pool.retries == 0 and pool.failures == 2


def test_a_batch_nobody_waits_for_is_cancelled_on_its_worker(no_ray: list[Any]) -> None:
    worker = FakeWorker("w", {"r0": None, "r1": None})
    pool = _pool([worker], concurrency=2)

    async def run() -> None:
        answers = pool.submit(_calls(["r0", "r1"]))
        await asyncio.sleep(0.05)
        assert sum(pool._in_flight.values()) == 2
        for answer in answers:
            answer.cancel()
        await asyncio.sleep(0.05)
        assert sum(pool._in_flight.values()) == 0  # the slots are free again

    asyncio.run(run())
    assert [what for what, _ in no_ray] == ["cancel"]  # once, not once per call
    assert pool.retries == 0 and pool.replaced == 0
