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

    def __init__(
        self,
        name: str,
        delays: dict[str, float | None],
        dies_after: float | None = None,
        lost: frozenset[str] = frozenset(),
    ) -> None:
        """`lost`: the calls that answer as a sandbox that is gone (not retryable)."""
        self.name, self.delays, self.dies_after, self.lost = name, delays, dies_after, lost
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
        assert call.attempt == attempt
        output = RolloutOutput(agent_output=AgentOutput(messages=[], rollout_metrics={"attempt": attempt}))
        answer = {"output": output, "spans": [], "seconds": delay, "worker": self.name}
        if call.rollout_id in self.lost:
            answer |= {"lost": "its process exited (code -9)", "retry": False}
        return index, answer

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


def _answers_within(pool: Pool, calls: list[ProcessorCall], seconds: float = 5.0) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        return list(await asyncio.wait_for(asyncio.gather(*pool.submit(calls)), seconds))

    return asyncio.run(run())


def test_a_call_whose_input_cannot_be_built_fails_alone_and_its_batch_mates_run() -> None:
    worker = FakeWorker("w", {"bad": 0.01, "good": 0.01})

    def invalid(attempt: int) -> int:
        raise ValueError("messages: field required")

    calls = [ProcessorCall(invalid, "bad"), *_calls(["good"])]
    pool = _pool([worker], concurrency=2)
    bad, good = _answers_within(pool, calls)
    assert bad["output"].status == TaskStatus.FAILED
    assert "could not be sent" in bad["output"].error and "messages: field required" in bad["output"].error
    assert good["output"].status == TaskStatus.SUCCESS and worker.batches == [["good"]]
    assert pool._in_flight == {worker: 0} and pool._workers == [worker]


def test_a_batch_that_cannot_be_sent_fails_its_calls_and_kills_no_worker(
    no_ray: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = FakeWorker("w", {"r0": 0.01, "r1": 0.01})

    def unpicklable(batch: list[WorkerCall]) -> Any:
        raise TypeError("cannot pickle '_thread.lock' object")

    monkeypatch.setattr(worker, "remote", unpicklable)
    pool = _pool([worker], concurrency=2)
    answers = _answers_within(pool, _calls(["r0", "r1"]))
    assert all("cannot pickle" in a["output"].error for a in answers)
    assert pool._in_flight == {worker: 0} and no_ray == [] and not pool._tasks


def test_an_abandoned_call_whose_sandbox_is_gone_still_replaces_its_worker(no_ray: list[Any]) -> None:
    worker = FakeWorker("w", {"gone": 0.05, "waits": None}, lost=frozenset({"gone"}))
    pool = _pool([worker], concurrency=2)

    async def run() -> None:
        gone, _ = pool.submit(_calls(["gone", "waits"]))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.sleep(0.2)

    asyncio.run(run())
    assert ("kill", worker) in no_ray and pool._workers == [] and pool.replaced == 1


def test_an_abandoned_call_that_overruns_does_not_kill_its_worker_under_live_calls(
    no_ray: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call nobody waits for has no timer: while the cancel of its batch is on its way to the worker,
    a call sent later to the same worker ends well."""
    monkeypatch.setattr(worker_pool, "TIMEOUT_GRACE_S", 0.2)
    monkeypatch.setattr(worker_pool.ray, "cancel", lambda stream: None)  # not delivered yet
    worker = FakeWorker("w", {"abandoned": None, "mate": 0.2, "live": 0.5})
    pool = _pool([worker], concurrency=3, timeout=0.4)  # a call's timer: 0.6 s

    async def run() -> dict[str, Any]:
        abandoned, _ = pool.submit(_calls(["abandoned", "mate"]))
        await asyncio.sleep(0.01)
        abandoned.cancel()
        await asyncio.sleep(0.3)
        [live] = pool.submit(_calls(["live"]))  # it answers after the abandoned call's timer was due
        return await live

    live = asyncio.run(run())
    assert live["output"].status == TaskStatus.SUCCESS, live["output"].error
    assert no_ray == [] and pool._workers == [worker]


def _worker(stand_in: Any) -> worker_pool.ProcessorWorker:
    """A `ProcessorWorker` (no Ray) whose sandbox is `stand_in` (`SandboxedProcessor.call`)."""
    component = _pool([FakeWorker("unused", {})]).component
    worker = worker_pool.ProcessorWorker(b"", component, "rollout", [], "none", "gateway", False)
    worker.sandboxed = stand_in
    return worker


class Sandbox:
    """Answers each call at once; a rollout id in `raises` makes the call raise that exception."""

    def __init__(self, raises: dict[str, Exception] | None = None) -> None:
        self.raises = raises or {}

    async def close(self) -> None:
        pass

    async def call(self, payload: Any, rollout_id: str, output_type: Any, method: str) -> dict[str, Any]:
        if rollout_id in self.raises:
            raise self.raises[rollout_id]
        output = RolloutOutput(agent_output=AgentOutput(messages=[]))
        return {"output": output, "spans": [], "seconds": 0.0}


def _worker_answers(
    worker: worker_pool.ProcessorWorker, calls: list[WorkerCall]
) -> dict[int, dict[str, Any]]:
    async def run() -> dict[int, dict[str, Any]]:
        try:
            return dict([item async for item in worker.calls(calls)])
        finally:
            await worker.close()

    return asyncio.run(run())


def test_a_worker_fault_in_one_call_fails_that_call_only() -> None:
    from opd_trainer.sdk import ModelResource, RolloutInput

    payload = RolloutInput(
        messages=[{"role": "user", "content": "hi"}],
        model_resource=ModelResource(model_name="m", base_url="http://127.0.0.1:9/v1", api_key="k"),
    )
    worker = _worker(Sandbox({"r0": KeyError("completion_token_ids")}))
    answers = _worker_answers(worker, [WorkerCall(payload, "r0"), WorkerCall(payload, "r1")])
    assert answers[0]["output"].status == TaskStatus.FAILED
    assert "KeyError" in answers[0]["output"].error and answers[0]["output"].error.startswith("c: ")
    assert answers[1]["output"].status == TaskStatus.SUCCESS


def test_a_gateway_slow_to_close_a_key_leaves_it_to_the_driver_within_the_pools_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker answers without the calls well before the pool's grace runs out; the driver closes
    the key then (and the gateway answers it the same record)."""
    from aiohttp import web

    from opd_trainer.recorded_calls import CLOSE_ROUTE, GatewayKey

    test_over = asyncio.Event()

    async def answers_too_late(request: web.Request) -> web.Response:
        await test_over.wait()
        return web.json_response([[]])

    async def run() -> tuple[dict[int, dict[str, Any]], float]:
        app = web.Application()
        app.router.add_post(f"/v1{CLOSE_ROUTE}", answers_too_late)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        worker = _worker(Sandbox())
        key = GatewayKey(f"http://127.0.0.1:{port}/v1", "key", "secret")
        started = asyncio.get_running_loop().time()
        try:
            answers = dict([item async for item in worker.calls([WorkerCall(0, "r0", key)])])
            return answers, asyncio.get_running_loop().time() - started
        finally:
            test_over.set()
            await worker.close()
            await runner.cleanup()

    monkeypatch.setattr(worker_pool, "method_of", lambda payload: ("process", RolloutOutput))
    answers, seconds = asyncio.run(run())
    assert answers[0]["output"].status == TaskStatus.SUCCESS and "calls" not in answers[0]
    assert seconds < worker_pool.TIMEOUT_GRACE_S / 2 - 2.0
