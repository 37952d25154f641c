"""The program that runs a user processor inside the sandbox; its worker talks to it in JSON lines.

Started by `processor_channel` (never imported by trusted code that runs user code), as
`python -m opd_trainer.workers.processor_host --kind rollout --classpath functions.rollout.Agent ...`.
It unpacks the workspace into the sandbox's private `/tmp`, loads the class (or function) by
classpath, runs `setup()`, and then serves calls, up to `concurrency` at once, each bounded by the
component's `timeout`.

Standard input carries the worker's requests, one JSON object a line:
`{"type": "call", "id": N, "rollout_id": ..., "method": "process", "payload": {RolloutInput, RewardInput or
BeaconInput}}` (a beacon processor also serves `"method": "verify"`, its payload a BeaconVerifyInput) and
`{"type": "forward", "port": P, "socket": PATH}` (listen on 127.0.0.1:P, relay to the gateway socket)
and `{"type": "cancel", "id": N}` (stop call N: nobody waits for its answer; none is sent).
Standard output carries the answers: `{"type": "ready", "class_name": ...}` or
`{"type": "load_error", "message": ...}` once, then `{"type": "result", "id": N, "output": {...},
"spans": [...], "seconds": S}` per call. The user's own prints go to standard error (the worker's log):
file descriptor 1 is moved aside before any user code is imported. Nothing here is trusted by the
worker: every answer is validated there by the SDK's pydantic models.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, BinaryIO

from opd_trainer.errors import ProcessorLoadError

logger = logging.getLogger("opd_trainer.processor_host")
# A request line (a rollout's conversation) may be long; beyond this the worker has a bug.
MAX_LINE = 256 * 1024 * 1024


def one_line(exc: BaseException) -> str:
    """`Type: message` on one line (the first line of the message; tracebacks belong in logs)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class ProcessorHost:
    def __init__(self, args: argparse.Namespace, out: BinaryIO) -> None:
        self.kind: str = args.kind
        self.component: str = args.component
        self.timeout_s: float = args.timeout
        self._slots = asyncio.Semaphore(args.concurrency)
        self._out = out
        self._processor: Any = None
        self._servers: list[asyncio.Server] = []
        self._relay_loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._calls: dict[int, asyncio.Task[None]] = {}  # running calls by id, for `cancel`

    def send(self, message: dict[str, Any]) -> None:
        self._out.write(json.dumps(message, default=str).encode() + b"\n")
        self._out.flush()

    def load(self, args: argparse.Namespace) -> str:
        # Lazy: sandbox child: its import set stays minimal until the host is told what to load.
        from opd_trainer.sdk.tracing import configure_tracing, ensure_observed
        from opd_trainer.storage.zips import unpack_workspace
        from opd_trainer.workers.classpath import instantiate_processor, load_processor_class

        workspace = Path(args.workspace)
        unpack_workspace(Path(args.workspace_zip).read_bytes(), workspace)
        os.chdir(workspace)  # user code may open files relative to its workspace, as on Bailian
        if args.deps:
            sys.path.insert(0, args.deps)
        configure_tracing(f"opd-{self.kind}-worker")
        cls = load_processor_class(
            workspace, args.classpath, self.kind, component=self.component, isolate=False
        )
        self._processor = ensure_observed(instantiate_processor(cls, component=self.component))
        return type(self._processor).__name__

    def _payload(self, data: dict[str, Any], method: str) -> Any:
        # Lazy: sandbox child: its import set stays minimal until the host is told what to load.
        from opd_trainer.sdk.types import method_types

        input_type, _ = method_types(self.kind, method)
        return input_type.model_validate(data)

    def _failed(self, message: str) -> dict[str, Any]:
        return {"status": "FAILED", "error": message}

    async def call(self, request: dict[str, Any]) -> None:
        # Lazy: sandbox child: its import set stays minimal until the host is told what to load.
        from opd_trainer.sdk import call_processor
        from opd_trainer.sdk.tracing import collect_spans

        started = time.perf_counter()
        async with self._slots:
            try:
                payload = self._payload(request["payload"], request.get("method", "process"))
                result = await asyncio.wait_for(call_processor(self._processor, payload), self.timeout_s)
                output = result.model_dump(mode="json")
            except TimeoutError:
                output = self._failed(f"{self.component}: timed out after {self.timeout_s:g}s")
            except Exception as exc:
                logger.error(
                    "%s: process() raised\n%s",
                    self.component,
                    "".join(traceback.format_exception(exc, limit=-8)),
                )
                output = self._failed(f"{self.component}: {one_line(exc)}")
        self.send(
            {
                "type": "result",
                "id": request["id"],
                "output": output,
                "spans": collect_spans(request["rollout_id"]),
                "seconds": time.perf_counter() - started,
            }
        )

    async def forward(self, request: dict[str, Any]) -> None:
        """Starts a loopback relay to a gateway socket, on the relay thread's own event loop: user code
        that blocks its loop (a synchronous HTTP call inside `async def process`) must not block the
        relay its own request goes through."""
        # Lazy: sandbox child: its import set stays minimal until the host is told what to load.
        from opd_trainer.workers.relay import serve_tcp_to_unix

        if self._relay_loop is None:
            self._relay_loop = asyncio.new_event_loop()
            threading.Thread(target=self._relay_loop.run_forever, name="gateway-relay", daemon=True).start()
        started = asyncio.run_coroutine_threadsafe(
            serve_tcp_to_unix(int(request["port"]), str(request["socket"])), self._relay_loop
        )
        self._servers.append(await asyncio.wrap_future(started))
        self.send({"type": "forwarding", "port": request["port"]})

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=MAX_LINE)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            request = json.loads(line)
            if request["type"] == "cancel":
                running = self._calls.pop(request["id"], None)
                if running is not None:
                    running.cancel()
                continue
            handler = self.call if request["type"] == "call" else self.forward
            task = loop.create_task(handler(request))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            if request["type"] == "call":
                self._calls[request["id"]] = task
                task.add_done_callback(lambda _, call_id=request["id"]: self._calls.pop(call_id, None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["rollout", "reward", "beacon"], required=True)
    parser.add_argument("--classpath", required=True)
    parser.add_argument("--component", required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--workspace-zip", required=True)
    parser.add_argument("--workspace", required=True)
    parser.add_argument("--deps", default=None)
    args = parser.parse_args()
    # The answers' channel is a private copy of stdout; fd 1 becomes stderr, so a user's print (or a
    # library's) lands in the worker's log instead of corrupting the protocol.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    host = ProcessorHost(args, out)
    try:
        class_name = host.load(args)
    except ProcessorLoadError as exc:
        host.send({"type": "load_error", "message": exc.message})
        return
    except Exception as exc:  # the workspace itself (a bad zip): the worker reports it as a load error
        host.send({"type": "load_error", "message": one_line(exc)})
        return
    host.send({"type": "ready", "class_name": class_name})
    asyncio.run(host.serve())


if __name__ == "__main__":
    main()
