"""Autoscaled pool of Ray actors that run one user processor component (shared by rollout and reward pools).

Each `ProcessorWorkerActor` is trusted code: it never imports the user's processor. It runs it in a
sandboxed child process (`processor_channel.SandboxedProcessor`: bubblewrap, its own PID, IPC and
network namespaces, a clean environment, no Ray credential, memory and process bounds) and passes
calls to it as JSON validated by the SDK's models. The child loads the user's class by classpath
from the component's workspace, runs `setup()` once and then up to `concurrency` `process` calls at
once, each bounded by the component `timeout`. User failures are contained: an exception or a
timeout becomes a FAILED output with one line naming the component and the cause (the traceback goes
to the worker's log), never a crashed job. A sandbox that stops answering (synchronous code blocking
its event loop), exceeds `memory_size` (the kernel's cgroup limit, or the pool's check of the tree's
resident memory every `autoscale_interval_s`) or exits fails its calls naming the cause, and its
worker is killed and replaced. A worker that dies is replaced (one replacement per worker, never
beyond `max_capacity`) and its in-flight calls are retried with `attempt_id + 1`, a bounded number of
times.

The workspace travels as a zip through Ray's object store (so workers on any node get it) and is
unpacked inside the sandbox, into its private `/tmp`. `requirements.txt` (package specifiers only)
is installed by the worker into the sandbox's own folder, in a sandbox of its own; the component's
`env` is the child's environment, on top of the sandbox's allowlist.

Placement: with `OPD_USER_CODE_RESOURCE` set where the job driver runs (the Helm chart sets it to the
resource its user-code worker group advertises), every worker requires one unit of that Ray resource,
so user code runs only on those pods, which mount no data volume. Unset (the embedded default), workers
go wherever Ray has room.

`WorkerPool` places workers, hands queued calls to the least-loaded ones with a free slot (each worker
runs at most `concurrency` at once; the rest wait in the pool), and asks the shared `Autoscaler` every
`autoscale_interval_s` how many workers it should have. The calls dispatched in one loop turn (a step's
rollouts, submitted together) go to each worker in one Ray call, a streaming generator
(`ProcessorWorker.calls`) that yields each call's answer as it ends, so the driver still reacts to each
rollout on its own and timeouts, retries and the autoscaler's count stay per call. A rollout's worker
closes its gateway key once the user's `process` returned and returns the recorded calls with the
answer (`opd_trainer/recorded_calls.py`): the driver makes no call of its own to collect them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import ray
from ray.exceptions import RayActorError, TaskCancelledError

from opd_trainer.cluster.process_usage import process_tree_cpu_seconds
from opd_trainer.errors import ProcessorLoadError
from opd_trainer.jobspec.job_spec import FunctionComponent
from opd_trainer.recorded_calls import GatewayKey, close_key, reopen_key
from opd_trainer.records import LLMCall
from opd_trainer.sdk import TaskStatus
from opd_trainer.sdk.types import PROCESSOR_KINDS, method_of
from opd_trainer.storage.zips import pack_workspace
from opd_trainer.workers.autoscaler import Autoscaler, AutoscalerSettings, PoolSnapshot
from opd_trainer.workers.classpath import Kind
from opd_trainer.workers.processor_channel import SandboxedProcessor
from opd_trainer.workers.requirements import requirements_of
from opd_trainer.workers.sandbox import SandboxUnavailable, effective_mode

logger = logging.getLogger(__name__)

# The processor interface each component type implements: an evaluator the reward's (RewardInput ->
# RewardOutput; it scores validation rollouts only).
KIND_OF_COMPONENT: dict[str, Kind] = {
    "rollout": "rollout",
    "reward": "reward",
    "evaluator": "reward",
    "beacon": "beacon",
}
MAX_ATTEMPTS = 3
MB = 1024 * 1024
# A call's answer may come this long after the worker's own `timeout` before the pool gives up on it
# (Ray round trip and a loaded machine); then the worker is taken to be blocked and is killed. The
# worker's own watchdog on its sandbox fires at half this grace, so the worker normally answers first.
TIMEOUT_GRACE_S = 10.0
TIMEOUT_GRACE_FRACTION = 0.25
# Starting a worker: placing it, installing its requirements and loading the user's class.
START_TIMEOUT_S = 120.0
START_TIMEOUT_WITH_PIP_S = 900.0
STATS_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 10.0
RECORD_KEY_TIMEOUT_S = 1.5
"""How long a worker waits for the gateway to close (or, for a retried call, reopen) a rollout's key.
Both run inside the call the pool times at `timeout + grace`, after the sandbox may have used
`timeout + grace / 2`: with grace at least `TIMEOUT_GRACE_S`, a reopen and a close leave 2 s for the Ray
round trip, so a slow gateway never makes the pool kill a healthy worker. A close that takes longer is
left to the driver, whose close gets the same record (the gateway keeps a closed key's record)."""
USER_CODE_RESOURCE_ENV = "OPD_USER_CODE_RESOURCE"


def user_code_resources() -> dict[str, float]:
    """The custom Ray resource a processor worker requires (`OPD_USER_CODE_RESOURCE`), if any."""
    name = os.environ.get(USER_CODE_RESOURCE_ENV, "").strip()
    return {name: 1.0} if name else {}


def grace_s(timeout_s: float) -> float:
    return max(TIMEOUT_GRACE_S, TIMEOUT_GRACE_FRACTION * timeout_s)


@dataclass(frozen=True)
class WorkerCall:
    """One call as a worker gets it: the input, the rollout it is for, (a rollout's) the gateway key
    whose recorded calls the worker returns with the answer, and which attempt it is (a retry reopens
    the key first: the lost attempt's worker may have closed it). The key's secret stays in the
    worker: the sandbox gets the payload only."""

    payload: Any
    rollout_id: str
    record_key: GatewayKey | None = None
    attempt: int = 0


class ProcessorWorker:
    """A trusted worker: holds one sandboxed processor process and relays calls to it."""

    def __init__(
        self,
        workspace_zip: bytes,
        component: FunctionComponent,
        kind: Kind,
        requirements: list[str],
        mode: str,
        network: str,
        server: bool,
    ) -> None:
        """`mode` is `OPD_PROCESSOR_SANDBOX` where the driver runs; what it means is decided here, on
        the node that runs the user's code (`sandbox.effective_mode`), in `load`."""
        self.workspace_zip = workspace_zip
        self.component = component
        self.kind = kind
        self.requirements = requirements
        self.mode = mode
        self.network = network
        self.server = server
        self.memory_limit_mb = component.runtime.memory_size
        self.sandboxed: Any = None  # the SandboxedProcessor, once `load` has chosen its mode
        self._client: aiohttp.ClientSession | None = None

    async def load(self) -> str:
        """Starts the sandbox and the user's `setup()`; raises `ProcessorLoadError` naming the cause."""

        component, runtime = self.component, self.component.runtime
        try:
            mode = effective_mode(self.mode, server=self.server)  # type: ignore[arg-type]
        except SandboxUnavailable as exc:
            raise ProcessorLoadError(f"on this worker's node, {exc}", field="functions") from None
        self.sandboxed = SandboxedProcessor(
            workspace_zip=self.workspace_zip,
            classpath=component.fcmodel.classpath,
            kind=self.kind,
            component=component.name,
            concurrency=runtime.concurrency,
            timeout_s=component.timeout,
            answer_grace_s=grace_s(component.timeout) / 2,
            memory_mb=runtime.memory_size,
            scratch_mb=runtime.disk_size,
            cpus=runtime.cpu,
            runtime_env=dict(runtime.env),
            requirements=self.requirements,
            mode=mode,
            network=self.network,
        )
        return await self.sandboxed.start()

    async def calls(self, batch: list[WorkerCall]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """Runs a batch of calls at once and yields `(index in batch, answer)` as each ends (a Ray
        streaming generator: `num_returns="streaming"`). Cancelling it cancels the calls still running."""
        running = [asyncio.ensure_future(self._call(index, call)) for index, call in enumerate(batch)]
        try:
            for answer in asyncio.as_completed(running):
                yield await answer
        finally:
            for task in running:
                task.cancel()

    async def _call(self, index: int, call: WorkerCall) -> tuple[int, dict[str, Any]]:
        """One `process` call (or, for a `BeaconVerifyInput`, `verify`): {"output", "spans", "seconds"}
        (+ "lost", "retry" when the sandbox is gone), never raising: a fault of this worker's own
        fails this call alone, its batch-mates go on. With a `record_key`, the key is closed once the
        call has answered and its recorded calls come along as "calls" (left out when the gateway did
        not answer them: the driver closes the key then)."""
        started = time.perf_counter()
        try:
            answer = await self._process(call)
        except Exception as exc:
            logger.exception("%s: the worker failed its call", call.rollout_id)
            output_type = PROCESSOR_KINDS[self.kind][1]
            error = f"{self.component.name}: the worker failed the call ({type(exc).__name__}: {exc})"
            failed = output_type(status=TaskStatus.FAILED, error=error)
            return index, {"output": failed, "spans": [], "seconds": time.perf_counter() - started}
        if call.record_key is not None and "lost" not in answer:
            calls = await self._close_record_key(call.rollout_id, call.record_key)
            if calls is not None:
                answer["calls"] = calls
        return index, answer

    async def _process(self, call: WorkerCall) -> dict[str, Any]:
        method, output_type = method_of(call.payload)
        if output_type is None:  # not one of the SDK's inputs: validated as the kind's output
            output_type = PROCESSOR_KINDS[self.kind][1]
        if call.record_key is not None and call.attempt > 0:
            await self._reopen_record_key(call.rollout_id, call.record_key)
        return await self.sandboxed.call(call.payload, call.rollout_id, output_type, method)

    async def _close_record_key(self, rollout_id: str, key: GatewayKey) -> list[LLMCall] | None:
        """The key's recorded calls, closing it; None when the gateway did not answer them in time."""
        try:
            return await close_key(self._http(), key, RECORD_KEY_TIMEOUT_S)
        except Exception as exc:  # the driver closes the key then, and gets the same record
            logger.warning("%s: closing its gateway key failed (%r)", rollout_id, exc)
            return None

    async def _reopen_record_key(self, rollout_id: str, key: GatewayKey) -> None:
        """Reopens a retried rollout's key, which the lost attempt's worker may have closed."""
        try:
            if await reopen_key(self._http(), key, RECORD_KEY_TIMEOUT_S):
                return
            problem = "the gateway no longer knows it"
        except Exception as exc:
            problem = repr(exc)
        # The retry runs anyway: its calls are refused (401) and the rollout fails, naming it.
        logger.warning("%s: its gateway key could not be reopened for the retry (%s)", rollout_id, problem)

    def _http(self) -> aiohttp.ClientSession:
        """The client that closes rollout keys on their gateway, made on the actor's loop at first use."""
        if self._client is None:
            self._client = aiohttp.ClientSession()
        return self._client

    async def confinement(self) -> str:
        """What holds the user's code (sandbox, network, user, limits), for the job's events."""
        return self.sandboxed.describe()

    async def stats(self) -> dict[str, float]:
        resident = self.sandboxed.resident_mb()
        in_flight = len(self.sandboxed._pending)
        return {
            "in_flight": float(in_flight),
            "memory_fraction": resident / self.memory_limit_mb,
            "cpu_s": process_tree_cpu_seconds(),  # the worker and its sandboxed user process
        }

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
        if self.sandboxed is not None:
            await self.sandboxed.close()


ProcessorWorkerActor = ray.remote(ProcessorWorker)


@dataclass(frozen=True)
class ProcessorCall:
    """One call a pool runs: `make_payload(attempt_id)` builds its input (an attempt after a worker
    died gets a higher id); `record_key` as in `WorkerCall`."""

    make_payload: Callable[[int], Any]
    rollout_id: str
    record_key: GatewayKey | None = None


@dataclass(eq=False)
class _Queued:
    """A submitted call, from the queue to its answer."""

    call: ProcessorCall
    answer: asyncio.Future[dict[str, Any]]
    attempt: int = 0
    started: float = 0.0  # when it was last sent
    timer: asyncio.TimerHandle | None = None  # its `call_timeout_s`, while it is on a worker


@dataclass(eq=False)
class _Batch:
    """Calls sent to one worker in one streaming call; `open`: those not settled yet, by index."""

    worker: Any
    open: dict[int, _Queued]
    stream: Any = None  # the ObjectRefGenerator, once sent


class WorkerPool:
    """The workers of one component, scaled by the shared autoscaler. A subclass names the component
    types it runs (`component_types`)."""

    component_types: tuple[str, ...] = ()

    def __init__(
        self,
        job_id: str,
        component: FunctionComponent,
        workspace: Path,
        *,
        autoscale_interval_s: float = 1.0,
        scale_down_cooldown_s: float = 30.0,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        sandbox_mode: str = "auto",
        sandbox_network: str = "gateway",
        server: bool = False,
    ) -> None:
        """`sandbox_mode` (`OPD_PROCESSOR_SANDBOX`: auto, bwrap, none) and `sandbox_network`
        (`OPD_SANDBOX_NETWORK`) are read where the driver runs; `server`: the job comes from the job
        server, whose tenants' code runs only sandboxed. Each worker applies them on its own node."""
        if component.type not in self.component_types:
            wanted = " or ".join(self.component_types)
            raise ValueError(f"{component.name} is a {component.type} component, not a {wanted} component")
        self.job_id = job_id
        self.component = component
        self.kind: Kind = KIND_OF_COMPONENT[component.type]
        self.workspace = workspace
        self.autoscale_interval_s = autoscale_interval_s
        self.autoscaler = Autoscaler(
            AutoscalerSettings.from_runtime(component.runtime, scale_down_cooldown_s=scale_down_cooldown_s),
            pool=f"{component.type}:{component.name}",
            job_id=job_id,
            on_event=on_event,
        )
        self._workers: list[Any] = []
        self._in_flight: dict[Any, int] = {}  # calls sent to each worker and not answered yet
        # Workers the pool killed on purpose, and why: their calls fail with that reason, not a retry.
        self._killed: dict[Any, str] = {}
        self._starting = 0  # workers being started: they count against max_capacity
        self.sandbox_mode = sandbox_mode
        self.sandbox_network = sandbox_network
        self.server = server
        self.confinement: str | None = None  # what the first worker reported, for the job's events
        self._requirements: list[str] = []
        self._resources = user_code_resources()
        self._queue: collections.deque[_Queued] = collections.deque()  # calls waiting for a free slot
        self._dispatching: asyncio.Handle | None = None  # the dispatch this loop turn has scheduled
        self._tasks: set[asyncio.Task[None]] = set()  # batches in flight, workers being replaced
        self._workspace_ref: Any = None
        self._autoscale_task: asyncio.Task[None] | None = None
        self.calls = 0
        self.failures = 0
        self.call_seconds = 0.0  # seconds the user's process calls took, failed ones included
        # Each worker's latest CPU-seconds (from its stats): a worker gone keeps its last reading.
        self._cpu_seconds: dict[Any, float] = {}
        self.retries = 0  # calls sent again after their worker died
        self.replaced = 0  # workers dropped (died, or killed for a timeout or memory) and replaced
        self.history: list[dict[str, Any]] = []

    @property
    def field(self) -> str:
        return f"functions.{self.component.name}.fcmodel"

    @property
    def call_timeout_s(self) -> float:
        """How long the pool waits for one call's answer before it kills the worker."""
        return self.component.timeout + grace_s(self.component.timeout)

    async def _new_worker(self) -> Any:
        runtime = self.component.runtime
        worker = ProcessorWorkerActor.options(  # type: ignore[attr-defined]
            num_cpus=runtime.cpu,
            memory=runtime.memory_size * MB,
            resources=self._resources,
            max_concurrency=max(16, runtime.concurrency * 2),
        ).remote(
            self._workspace_ref,
            self.component,
            self.kind,
            self._requirements,
            self.sandbox_mode,
            self.sandbox_network,
            self.server,
        )
        start_timeout = START_TIMEOUT_WITH_PIP_S if self._requirements else START_TIMEOUT_S
        try:
            await asyncio.wait_for(worker.load.remote(), start_timeout)
        except TimeoutError:
            ray.kill(worker)
            needs = f"cpu {runtime.cpu}, memory_size {runtime.memory_size} MB"
            if self._resources:
                needs += f", Ray resource {next(iter(self._resources))} ({USER_CODE_RESOURCE_ENV})"
            raise ProcessorLoadError(
                f"a worker did not start within {start_timeout:.0f}s: Ray could not place it "
                f"({needs}), its requirements did not install or its setup() did not return",
                field=self.field,
            ) from None
        except ProcessorLoadError:
            ray.kill(worker)
            raise
        if self.confinement is None:
            self.confinement = await worker.confinement.remote()
        self._workers.append(worker)
        self._in_flight[worker] = 0
        return worker

    async def start(self) -> None:
        """Starts `capacity` workers (at least one: load errors surface before training) + the autoscaler."""
        self._requirements = requirements_of(self.workspace, field=f"{self.field}.requirements.txt")
        self._workspace_ref = ray.put(pack_workspace(self.workspace))
        initial = max(1, self.autoscaler.initial_workers())
        await asyncio.gather(*(self._new_worker() for _ in range(initial)))
        self._autoscale_task = asyncio.get_running_loop().create_task(self._autoscale_loop())

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._tasks.discard)

    def _dispatch_soon(self) -> None:
        """Dispatches at the end of this loop turn, so that calls submitted or slots freed in one turn
        go out together: one Ray call per worker."""
        if self._dispatching is None:
            self._dispatching = asyncio.get_running_loop().call_soon(self._dispatch)

    def _dispatch(self) -> None:
        """Hands the queued calls to the least-loaded workers with a free slot (`concurrency` calls in
        flight each) and sends each worker its share in one streaming call (`_run_batch`)."""
        self._dispatching = None
        concurrency = self.component.runtime.concurrency
        batches: dict[Any, list[_Queued]] = {}
        while self._queue:
            ready = [w for w in self._workers if self._in_flight[w] < concurrency]
            if not ready:
                break
            queued = self._queue.popleft()
            if queued.answer.done():  # cancelled while it waited
                continue
            worker = min(ready, key=self._in_flight.__getitem__)
            self._in_flight[worker] += 1
            batches.setdefault(worker, []).append(queued)
        for worker, batch in batches.items():
            self._spawn(self._run_batch(_Batch(worker, dict(enumerate(batch)))))

    def _release(self, worker: Any) -> None:
        if worker in self._in_flight:
            self._in_flight[worker] -= 1
            self._dispatch_soon()

    async def _add_worker_within_max(self) -> bool:
        """Starts one worker unless running + starting workers already reach `max_capacity`."""
        if len(self._workers) + self._starting >= self.autoscaler.settings.max_capacity:
            return False
        self._starting += 1
        try:
            await self._new_worker()
        finally:
            self._starting -= 1
        self._dispatch_soon()
        return True

    async def _add_replacement(self) -> None:
        try:
            await self._add_worker_within_max()
        except Exception as exc:  # the autoscaler retries from min_capacity on its next tick
            logger.error("[%s] replacing a %s worker failed: %s", self.job_id, self.component.name, exc)

    def _replace(self, dead: Any, reason: str = "died") -> None:
        """Drops `dead` and starts one replacement; calls that lost the same worker start none."""
        if dead not in self._in_flight:
            return
        self._workers.remove(dead)
        del self._in_flight[dead]
        self.replaced += 1
        logger.warning("[%s] %s worker %s; starting a replacement", self.job_id, self.component.name, reason)
        self._spawn(self._add_replacement())

    def _kill(self, worker: Any, reason: str) -> None:
        """Kills a worker on purpose (blocked or over its memory), records why, and replaces it: its
        calls fail with that reason instead of being retried."""
        self._killed[worker] = reason
        ray.kill(worker)
        self._replace(worker, reason)

    def submit(self, calls: list[ProcessorCall]) -> list[asyncio.Future[dict[str, Any]]]:
        """Queues `calls`; each future gets its call's answer: {"output", "spans", "seconds",
        "attempt_id"} (+ "calls": a rollout's recorded calls, when its worker returned them).

        Calls submitted in one loop turn go out together, each worker's share in one Ray call whose
        answers stream back as each call ends. A call runs at most `call_timeout_s` on its worker; a
        worker that dies takes its unanswered calls to other workers (`attempt_id + 1`, at most
        `MAX_ATTEMPTS` times). Failures come as a FAILED output naming the cause, never as an
        exception. Cancelling a future gives up its call (the worker's batch is cancelled once none of
        its calls is wanted)."""
        loop = asyncio.get_running_loop()
        queued = [_Queued(call, loop.create_future()) for call in calls]
        self._queue.extend(queued)
        self._dispatch_soon()
        return [q.answer for q in queued]

    async def run(self, make_payload: Callable[[int], Any], rollout_id: str) -> dict[str, Any]:
        """One call (`submit`); `make_payload(attempt_id)` builds its input."""
        [answer] = self.submit([ProcessorCall(make_payload, rollout_id)])
        return await answer

    async def _run_batch(self, batch: _Batch) -> None:
        """Sends `batch` to its worker in one streaming call and settles each call as its answer comes
        (`_settle`), or when it times out (`_timed_out`); a worker lost under the batch fails or retries
        what it still owed (`_lost_worker`)."""
        if not self._send(batch):
            return
        try:
            async for ref in batch.stream:
                index, answer = await ref
                self._settle(batch, index, answer)
        except TaskCancelledError:  # no caller wanted its calls any more (`_abandon_if_unwanted`)
            pass
        except RayActorError:
            self._lost_worker(batch)
        except asyncio.CancelledError:  # the pool shuts down
            for index in list(batch.open):
                self._take(batch, index).answer.cancel()
            raise
        except Exception:  # a fault of the worker's own code: its calls fail, naming it
            logger.exception("[%s] a %s batch failed", self.job_id, self.component.name)
        for index in list(batch.open):
            queued = self._take(batch, index)
            if not queued.answer.done():
                self._fail(queued, "its worker ended the batch without answering it (see the job's log)")

    def _send(self, batch: _Batch) -> bool:
        """Builds each call's input and sends the batch to its worker, then starts each call's timer.
        A call whose input cannot be built fails alone; when the batch cannot be sent (an input that
        does not pickle) its calls fail; each names the cause. Whether anything was sent."""
        built: list[tuple[_Queued, WorkerCall]] = []
        for index in list(batch.open):
            queued = batch.open[index]
            try:
                payload = queued.call.make_payload(queued.attempt)
            except Exception as exc:
                self._fail_unsent(self._take(batch, index), exc)
                continue
            call = queued.call
            built.append((queued, WorkerCall(payload, call.rollout_id, call.record_key, queued.attempt)))
        batch.open = {index: queued for index, (queued, _) in enumerate(built)}
        if not built:
            return False
        try:
            batch.stream = batch.worker.calls.options(num_returns="streaming").remote([c for _, c in built])
        except Exception as exc:
            for index in list(batch.open):
                self._fail_unsent(self._take(batch, index), exc)
            return False
        loop = asyncio.get_running_loop()
        for index, queued in batch.open.items():
            queued.started = time.perf_counter()
            queued.timer = loop.call_later(self.call_timeout_s, self._timed_out, batch, index)
            queued.answer.add_done_callback(lambda _, b=batch: self._abandon_if_unwanted(b))
        return True

    def _fail_unsent(self, queued: _Queued, exc: Exception) -> None:
        logger.error("[%s] %s: its call could not be sent (%r)", self.job_id, queued.call.rollout_id, exc)
        if not queued.answer.done():
            self._fail(queued, f"its call could not be sent to a worker ({type(exc).__name__}: {exc})")

    def _take(self, batch: _Batch, index: int) -> _Queued:
        """Removes a call from its batch (it is settled now): its timer stops, its slot is free."""
        queued = batch.open.pop(index)
        if queued.timer is not None:
            queued.timer.cancel()
        self._release(batch.worker)
        return queued

    def _settle(self, batch: _Batch, index: int, answer: dict[str, Any]) -> None:
        if index not in batch.open:  # timed out already
            return
        queued = self._take(batch, index)
        lost = answer.pop("lost", None)
        if lost is not None:  # the sandbox is gone: replace its worker, even if nobody waits for this call
            retry = answer.pop("retry")
            if retry:  # it exited, as a dying worker would: send the call again
                ray.kill(batch.worker)  # its other calls see a dead worker and are retried too
                self._replace(batch.worker, lost)
            else:
                self._kill(batch.worker, lost)
            if queued.answer.done():  # its caller gave up on it
                return
            if retry:
                self._retry(queued)
            else:
                self._fail(queued, lost, answer["seconds"])
            return
        if queued.answer.done():  # its caller gave up on it
            return
        self.calls += 1
        self.call_seconds += float(answer.get("seconds", 0.0))
        answer["attempt_id"] = queued.attempt
        queued.answer.set_result(answer)

    def _timed_out(self, batch: _Batch, index: int) -> None:
        """A call's answer is `call_timeout_s` late: its worker is taken to be blocked and killed."""
        queued = self._take(batch, index)
        queued.timer = None
        reason = (
            f"timed out after {self.component.timeout:g}s and its worker did not answer "
            "(synchronous code blocking the event loop?); the worker was restarted"
        )
        self._kill(batch.worker, reason)
        if not queued.answer.done():
            self._fail(queued, reason, time.perf_counter() - queued.started)

    def _lost_worker(self, batch: _Batch) -> None:
        """The worker died (or the pool killed it) with calls of `batch` unanswered: calls of a worker
        killed on purpose fail with its reason; the others go to another worker."""
        killed = self._killed.get(batch.worker)
        if killed is None and batch.open:
            self._replace(batch.worker)
        for index in list(batch.open):
            queued = self._take(batch, index)
            if queued.answer.done():
                continue
            if killed is not None:
                self._fail(queued, killed, time.perf_counter() - queued.started)
            else:
                self._retry(queued)

    def _retry(self, queued: _Queued) -> None:
        self.retries += 1
        if queued.attempt + 1 >= MAX_ATTEMPTS:
            self._fail(queued, f"worker died {MAX_ATTEMPTS} times")
            return
        queued.attempt += 1
        self._queue.appendleft(queued)
        self._dispatch_soon()

    def _abandon_if_unwanted(self, batch: _Batch) -> None:
        """A call of `batch` nobody waits for loses its timer: its overrun must not kill the worker
        under batch-mates still wanted (the worker's own limits still bound it). It keeps its slot until
        the worker answers it, since the sandbox still runs it: a call sent in its place would wait
        there for it while its own timer ran. Once no caller waits for any of the batch's calls (a step
        that failed or was stopped), the batch is cancelled on its worker, which cancels them in its
        sandbox and frees their slots."""
        for queued in batch.open.values():
            if queued.answer.done() and queued.timer is not None:
                queued.timer.cancel()
                queued.timer = None
        if batch.stream is not None and batch.open and all(q.answer.done() for q in batch.open.values()):
            ray.cancel(batch.stream)
            batch.stream = None  # cancelled once; `_run_batch` reads the stream it was given

    def _fail(self, queued: _Queued, reason: str, seconds: float = 0.0) -> None:
        queued.answer.set_result(self._failure(reason, queued.attempt, seconds))

    def _failure(self, reason: str, attempt: int, seconds: float) -> dict[str, Any]:

        self.calls += 1
        self.call_seconds += seconds
        self.failures += 1
        _, output_type, _ = PROCESSOR_KINDS[self.kind]
        return {
            "output": output_type(status=TaskStatus.FAILED, error=f"{self.component.name}: {reason}"),
            "spans": [],
            "seconds": seconds,
            "attempt_id": attempt,
        }

    async def _stats(self, worker: Any) -> dict[str, float] | None:
        try:  # a worker whose event loop is blocked does not answer; its call's timeout handles it
            return await asyncio.wait_for(worker.stats.remote(), STATS_TIMEOUT_S)  # type: ignore[no-any-return]
        except (TimeoutError, RayActorError):
            return None

    async def _worker_stats(self) -> dict[Any, dict[str, float] | None]:
        workers = list(self._workers)
        stats = dict(zip(workers, await asyncio.gather(*(self._stats(w) for w in workers)), strict=True))
        for worker, numbers in stats.items():
            if numbers is not None and "cpu_s" in numbers:
                self._cpu_seconds[worker] = numbers["cpu_s"]
        return stats

    async def usage(self) -> dict[str, float]:
        """Calls, their seconds and the workers' CPU-seconds so far (metering); reads every live
        worker now, so the figure is current."""
        await self._worker_stats()
        return {
            "calls": float(self.calls),
            "call_seconds": self.call_seconds,
            "cpu_s": float(sum(self._cpu_seconds.values())),
        }

    def _enforce_memory(self, stats: dict[Any, dict[str, float] | None]) -> None:
        """Kills (and replaces) every worker whose resident memory exceeds the component's memory_size."""
        limit = self.component.runtime.memory_size
        for worker, stat in stats.items():
            if stat is not None and stat["memory_fraction"] > 1.0 and worker in self._in_flight:
                used = stat["memory_fraction"] * limit
                self._kill(worker, f"exceeded memory_size {limit} MB (resident {used:.0f} MB); worker killed")

    def _snapshot(self, stats: dict[Any, dict[str, float] | None]) -> PoolSnapshot:
        memory = [s["memory_fraction"] for w, s in stats.items() if s is not None and w in self._in_flight]
        in_flight = sum(self._in_flight.values())
        idle = sum(1 for w in self._workers if self._in_flight[w] == 0)
        return PoolSnapshot(
            len(self._workers),
            in_flight,
            len(self._queue),
            idle,
            max(memory) if memory else None,
            starting=self._starting,
        )

    async def autoscale_once(self) -> None:
        stats = await self._worker_stats()
        self._enforce_memory(stats)
        decision = self.autoscaler.decide(self._snapshot(stats))
        self.history.append(
            {
                "time": time.time(),
                "workers": decision.current,
                "desired": decision.desired,
                "action": decision.action,
                "utilisation": decision.utilisation,
            }
        )
        if decision.action == "up":
            await asyncio.gather(
                *(self._add_worker_within_max() for _ in range(decision.start)),
                return_exceptions=True,
            )
        elif decision.action == "down":
            idle = [w for w in self._workers if self._in_flight[w] == 0][: decision.remove]
            for worker in idle:
                self._workers.remove(worker)
                del self._in_flight[worker]
                ray.kill(worker)

    async def _autoscale_loop(self) -> None:
        while True:
            await asyncio.sleep(self.autoscale_interval_s)
            try:
                await self.autoscale_once()
            except Exception:  # scaling trouble must not kill the job; the next tick retries
                logger.exception("[%s] autoscaling %s failed", self.job_id, self.component.name)

    @property
    def size(self) -> int:
        return len(self._workers)

    async def shutdown(self) -> None:
        if self._autoscale_task is not None:
            self._autoscale_task.cancel()
        for task in list(self._tasks):
            task.cancel()
        while self._queue:
            self._queue.popleft().answer.cancel()
        # Each worker removes its sandbox's folder and groups first; one that does not answer is
        # killed anyway (the next worker on its node removes what it left).
        closing = [asyncio.wait_for(worker.close.remote(), CLOSE_TIMEOUT_S) for worker in self._workers]
        await asyncio.gather(*closing, return_exceptions=True)
        for worker in self._workers:
            ray.kill(worker)
        self._workers.clear()
        self._in_flight.clear()


def pool_metrics(pools: list[WorkerPool]) -> dict[str, float]:
    """Per pool, as `pool/NAME/...`: workers now, the autoscaler's last view (desired workers, calls in
    flight and queued, utilisation), and running totals: scale-ups, scale-downs, workers replaced
    (died, or killed for a timeout or memory) and calls retried."""
    metrics: dict[str, float] = {}
    for pool in pools:
        prefix = f"pool/{pool.component.name}"
        metrics[f"{prefix}/workers"] = float(pool.size)
        for name, value in pool.autoscaler.gauges.items():
            if name != "workers_current":  # `workers` is the live count
                metrics[f"{prefix}/{name}"] = value
        metrics[f"{prefix}/scale_ups"] = float(pool.autoscaler.scale_events["up"])
        metrics[f"{prefix}/scale_downs"] = float(pool.autoscaler.scale_events["down"])
        metrics[f"{prefix}/workers_replaced"] = float(pool.replaced)
        metrics[f"{prefix}/calls_retried"] = float(pool.retries)
    return metrics
