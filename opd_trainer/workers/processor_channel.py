"""The trusted end of a sandboxed processor: starts it, speaks JSON lines to it, bounds and kills it.

`SandboxedProcessor` is what a pool worker (a trusted Ray actor) holds instead of the user's object.
It writes the workspace zip into a private control folder, installs the workspace's requirements in
a sandbox of their own (`install_requirements`: package specifiers only, wheels only, the operator's
index), starts `processor_host` through the limits launcher and bubblewrap (`sandbox`), and then for
each call sends the input as JSON and validates the answer with the SDK's pydantic models: nothing
crosses the boundary as pickle, and nothing the sandbox says is trusted.

Gateways: each distinct gateway in a call's `model_resource` / `auxiliary_models` gets a Unix socket
in the control folder, relayed to the gateway (`relay`); the sandbox sees a loopback URL instead.
A sandbox that dies (its own exit, the kernel's memory limit) or stops answering (a blocked event
loop) fails its calls with the reason and marks itself lost; the pool then replaces the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psutil
from pydantic import BaseModel, ValidationError

from opd_trainer.cluster.process_usage import descendants
from opd_trainer.errors import ProcessorLoadError
from opd_trainer.workers import sandbox
from opd_trainer.workers.process_limits import GROUP_PREFIX, ProcessLimits, owner_alive
from opd_trainer.workers.relay import serve_unix_to_tcp

logger = logging.getLogger(__name__)

MB = 1024 * 1024
# One answer line (a rollout's whole conversation) may be long; a longer one is a hostile sandbox.
MAX_ANSWER_BYTES = 64 * MB
MAX_SPANS = 2000
# Loopback ports inside the sandbox's own network namespace, one per gateway it reaches.
FIRST_FORWARD_PORT = 18000
INSTALL_TIMEOUT_S = 900.0
PIP_INDEX_ENV = "OPD_PIP_INDEX_URL"
MAX_PROCESSES_ENV = "OPD_SANDBOX_MAX_PROCESSES"
DEFAULT_MAX_PROCESSES = 512


def remove_stale_control_dirs() -> None:
    """Removes the control folders (workspace zip, installed requirements, sockets) of workers that
    are gone: Ray kills a worker with SIGKILL, which leaves no chance to clean up."""
    for folder in Path(tempfile.gettempdir()).glob(f"{GROUP_PREFIX}*"):
        if folder.is_dir() and not owner_alive(folder.name):
            shutil.rmtree(folder, ignore_errors=True)


def max_processes() -> int:
    value = os.environ.get(MAX_PROCESSES_ENV, "").strip()
    return int(value) if value else DEFAULT_MAX_PROCESSES


class SandboxedProcessor:
    """One user processor in its own sandboxed process (see the module docstring)."""

    def __init__(
        self,
        *,
        workspace_zip: bytes,
        classpath: str,
        kind: str,
        component: str,
        concurrency: int,
        timeout_s: float,
        answer_grace_s: float,
        memory_mb: int,
        scratch_mb: int,
        cpus: float,
        runtime_env: dict[str, str],
        requirements: list[str],
        mode: str,
        network: str,
    ) -> None:
        self.kind = kind
        self.component = component
        self.classpath = classpath
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.answer_grace_s = answer_grace_s
        self.memory_mb = memory_mb
        self.scratch_mb = scratch_mb
        self.cpus = cpus
        self.runtime_env = runtime_env
        self.requirements = requirements
        self.mode = mode
        self.network = network if mode == "bwrap" else "host"
        self.uid = sandbox.launcher_uid()
        remove_stale_control_dirs()
        self.control_dir = Path(tempfile.mkdtemp(prefix=f"{GROUP_PREFIX}{os.getpid()}-"))
        os.chmod(self.control_dir, 0o755)  # the sandbox's user reads the zip and connects to sockets
        self.zip_path = self.control_dir / "workspace.zip"
        self.zip_path.write_bytes(workspace_zip)
        os.chmod(self.zip_path, 0o644)
        self.deps_dir: Path | None = None
        self.limits: ProcessLimits | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._started: asyncio.Future[dict[str, Any]] | None = None
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._forwarding: dict[int, asyncio.Future[None]] = {}
        # (host, port) of a gateway -> its loopback port in the sandbox, once the relay is open
        self._gateways: dict[tuple[str, int], asyncio.Future[int]] = {}
        self._relays: list[asyncio.Server] = []
        self._next_id = 0
        self.lost: str | None = None  # why the sandbox is gone; None while it serves
        self.retryable = False  # whether calls it lost may be sent again (it exited, or never got them)

    # -- paths as the sandboxed process sees them ---------------------------------------------------
    def _inside(self, host_path: Path, sandbox_path: str) -> str:
        return sandbox_path if self.mode == "bwrap" else str(host_path)

    def _layout(self, *, deps_writable: bool = False, network: str | None = None) -> sandbox.SandboxLayout:
        return sandbox.SandboxLayout(
            control_dir=self.control_dir,
            deps_dir=self.deps_dir,
            scratch_mb=self.scratch_mb,
            network=network or self.network,  # type: ignore[arg-type]
            deps_writable=deps_writable,
        )

    def _argv(self, command: list[str], env: dict[str, str], **layout: Any) -> list[str]:
        """The whole command line: limits launcher, then bubblewrap (mode bwrap), then `command`."""
        assert self.limits is not None
        launcher = [*self.limits.launcher_argv(self.uid), "--"]
        if self.mode == "bwrap":
            return [*launcher, *sandbox.bwrap_command(self._layout(**layout), env, command)]
        return [*launcher, *command]

    def describe(self) -> str:
        where = "bubblewrap" if self.mode == "bwrap" else "no sandbox"
        network = f", network {self.network}" if self.mode == "bwrap" else ""
        limits = self.limits.describe() if self.limits else "no limits yet"
        user = f", user {sandbox.user_mode()}"
        return f"{where}{network}{user}; {limits}"

    # -- start ----------------------------------------------------------------------------------------
    async def start(self) -> str:
        """Installs requirements, starts the host and waits for `setup()`; returns the class name."""
        try:
            return await self._start()
        except BaseException:
            await self.close()  # its folder, groups and processes, whatever stopped the start
            raise

    async def _start(self) -> str:
        self.limits = await asyncio.to_thread(ProcessLimits.create, self.memory_mb, max_processes())
        if self.requirements:
            await self._install_requirements()
        env = sandbox.sandbox_environment(
            self.runtime_env, mode=self.mode, cpus=self.cpus, has_deps=self.deps_dir is not None
        )
        if self.mode != "bwrap":
            env = {**env, "PATH": os.environ.get("PATH", env["PATH"])}
        workspace = self._inside(self.control_dir / "workspace", sandbox.WORKSPACE_DIR)
        host = [sys.executable, "-s", "-m", "opd_trainer.workers.processor_host"]
        host += ["--kind", self.kind, "--classpath", self.classpath, "--component", self.component]
        host += ["--concurrency", str(self.concurrency), "--timeout", str(self.timeout_s)]
        host += ["--workspace-zip", self._inside(self.zip_path, f"{sandbox.CONTROL_DIR}/workspace.zip")]
        host += ["--workspace", workspace]
        if self.deps_dir is not None:
            host += ["--deps", self._inside(self.deps_dir, sandbox.DEPS_DIR)]
        if self.mode != "bwrap":
            # Unconfined, the host's workspace is a folder of this worker's (there is no private /tmp).
            (self.control_dir / "workspace").mkdir()
        self._process = await asyncio.create_subprocess_exec(
            *self._argv(host, env),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env if self.mode != "bwrap" else {"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            limit=MAX_ANSWER_BYTES,
            start_new_session=True,
        )
        self._started = asyncio.get_running_loop().create_future()
        self._reader = asyncio.get_running_loop().create_task(self._read_answers())
        first = await self._started
        if first["type"] != "ready":
            raise ProcessorLoadError(
                str(first.get("message", "the processor did not start")), field=self._field
            )
        return str(first.get("class_name", ""))

    @property
    def _field(self) -> str:
        return f"functions.{self.component}.fcmodel"

    async def _install_requirements(self) -> None:
        """`pip install --target` inside a sandbox with the node's network (to reach the index), the
        deps folder its only writable host folder; wheels only, so no package's code runs here."""
        self.deps_dir = self.control_dir / "deps"
        self.deps_dir.mkdir()
        if self.uid is not None:
            os.chown(self.deps_dir, self.uid, self.uid)
        target = self._inside(self.deps_dir, sandbox.DEPS_DIR)
        pip = [sys.executable, "-s", "-m", "pip", "install", "--no-input", "--disable-pip-version-check"]
        pip += ["--no-cache-dir", "--only-binary=:all:", "--target", target]
        index = os.environ.get(PIP_INDEX_ENV, "").strip()
        if index:
            pip += ["--index-url", index]
        pip += self.requirements  # package specifiers only (workers.requirements), never options
        env = sandbox.sandbox_environment({}, mode=self.mode, cpus=self.cpus, has_deps=False)
        if self.mode != "bwrap":
            env = {**env, "PATH": os.environ.get("PATH", env["PATH"])}
        process = await asyncio.create_subprocess_exec(
            *self._argv(pip, env, deps_writable=True, network="host"),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=env if self.mode != "bwrap" else {"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            start_new_session=True,
        )
        try:
            _, stderr = await asyncio.wait_for(process.communicate(), INSTALL_TIMEOUT_S)
        except TimeoutError:
            process.kill()
            raise ProcessorLoadError(
                f"requirements.txt did not install within {INSTALL_TIMEOUT_S:.0f}s", field=self._field
            ) from None
        if process.returncode != 0:
            lines = stderr.decode(errors="replace").splitlines()
            errors = [line for line in lines if line.startswith("ERROR")] or lines[-3:]
            raise ProcessorLoadError(
                "requirements.txt failed to install: " + " ".join(errors)[:1500], field=self._field
            )
        used = sum(f.stat().st_size for f in self.deps_dir.rglob("*") if f.is_file())
        if used > self.scratch_mb * MB:
            raise ProcessorLoadError(
                f"requirements.txt installs {used / MB:.0f} MB, more than runtime.disk_size "
                f"({self.scratch_mb} MB)",
                field=self._field,
            )

    # -- answers --------------------------------------------------------------------------------------
    async def _read_answers(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        stdout = self._process.stdout
        try:
            while line := await stdout.readline():
                self._dispatch(json.loads(line))
        except (ValueError, asyncio.LimitOverrunError) as exc:  # garbage or an endless line
            logger.error("%s: the sandbox sent an invalid answer (%s); killing it", self.component, exc)
            await self._kill()
        await self._exited()

    def _dispatch(self, message: Any) -> None:
        if not isinstance(message, dict):
            raise ValueError("an answer must be a JSON object")
        kind = message.get("type")
        if kind in ("ready", "load_error") and self._started is not None and not self._started.done():
            self._started.set_result(message)
        elif kind == "result":
            future = self._pending.pop(message.get("id"), None)  # type: ignore[arg-type]
            if future is not None and not future.done():
                future.set_result(message)
        elif kind == "forwarding":
            waiter = self._forwarding.pop(message.get("port"), None)  # type: ignore[arg-type]
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def _exited(self) -> None:
        """The sandbox is gone: say why, and fail whatever it still owed."""
        assert self._process is not None
        code = await self._process.wait()
        if self.lost is None:
            if self.limits is not None and self.limits.out_of_memory():
                self.lost = f"exceeded memory_size {self.memory_mb} MB; its processes were killed"
            else:
                self.lost = f"its process exited (code {code})"
                self.retryable = True  # as a worker that died: its calls go to a replacement
        if self.limits is not None:
            self.limits.kill_all()
        if self._started is not None and not self._started.done():
            self._started.set_result({"type": "load_error", "message": f"the processor {self.lost}"})
        for future in [*self._pending.values(), *self._forwarding.values()]:
            if not future.done():
                future.set_exception(ConnectionError(self.lost))
        self._pending.clear()
        self._forwarding.clear()

    # -- calls ----------------------------------------------------------------------------------------
    async def _sandbox_url(self, url: str) -> str:
        """The URL of a gateway as the sandbox reaches it: a loopback port relayed to the gateway."""
        if self.network != "gateway":
            return url
        parts = urlsplit(url)
        key = (parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80))
        relay = self._gateways.get(key)
        if relay is None:  # the first call to reach this gateway opens its relay; others wait for it
            port = FIRST_FORWARD_PORT + len(self._gateways)
            relay = self._gateways[key] = asyncio.ensure_future(self._open_relay(key, port))
        port = await asyncio.shield(relay)
        return urlunsplit((parts.scheme, f"127.0.0.1:{port}", parts.path, parts.query, parts.fragment))

    async def _open_relay(self, gateway: tuple[str, int], port: int) -> int:
        socket_path = self.control_dir / f"gateway-{port}.sock"
        self._relays.append(await serve_unix_to_tcp(str(socket_path), *gateway))
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._forwarding[port] = waiter
        self._send({"type": "forward", "port": port, "socket": f"{sandbox.CONTROL_DIR}/{socket_path.name}"})
        await waiter
        return port

    async def _wire_payload(self, payload: BaseModel) -> dict[str, Any]:
        """The payload as JSON for the sandbox: keys in clear (they are its credential), gateway URLs
        rewritten to the sandbox's relays."""
        data = payload.model_dump(mode="json")
        resources: list[tuple[dict[str, Any], Any]] = []
        model_resource = getattr(payload, "model_resource", None)
        if model_resource is not None:
            resources.append((data["model_resource"], model_resource))
        for name, resource in (getattr(payload, "auxiliary_models", None) or {}).items():
            resources.append((data["auxiliary_models"][name], resource))
        for wire, resource in resources:
            wire["api_key"] = resource.api_key.get_secret_value()
            wire["base_url"] = await self._sandbox_url(resource.base_url)
        return data

    def _send(self, message: dict[str, Any]) -> None:
        """Writes one message to the sandbox; ConnectionError when its stdin is already closed (the
        process exited between the last check and this write: uvloop raises RuntimeError there)."""
        assert self._process is not None and self._process.stdin is not None
        stdin = self._process.stdin
        if stdin.is_closing():
            raise ConnectionError(self.lost or "its process exited")
        try:
            stdin.write(json.dumps(message).encode() + b"\n")
        except RuntimeError as exc:  # a transport closed under the write
            raise ConnectionError(self.lost or "its process exited") from exc

    async def call(
        self, payload: BaseModel, rollout_id: str, output_type: type[BaseModel], method: str = "process"
    ) -> dict[str, Any]:
        """One call of the processor's `method` (`process`; a beacon processor's `verify`). Returns
        {"output", "spans", "seconds"} and, when the sandbox is gone,
        "lost" (why) and "retry" (whether the call may be sent to another worker: the sandbox exited,
        or never received it; not after a timeout, the memory limit or an invalid answer)."""
        started = time.perf_counter()
        if self.lost is not None:
            return self._failure(output_type, self.lost, started, retry=True)
        self._next_id += 1
        call_id = self._next_id
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            wire = await self._wire_payload(payload)
        except (ConnectionError, OSError):
            self._pending.pop(call_id, None)
            reason = self.lost or "its process exited"
            return self._failure(output_type, reason, started, retry=self.retryable)
        except asyncio.CancelledError:  # cancelled before the sandbox got the call: nothing to stop
            self._pending.pop(call_id, None)
            raise
        try:
            call = {"type": "call", "id": call_id, "rollout_id": rollout_id, "method": method}
            self._send({**call, "payload": wire})
        except ConnectionError:  # it never received the call: another worker may take it
            self._pending.pop(call_id, None)
            return self._failure(output_type, self.lost or "its process exited", started, retry=True)
        try:
            assert self._process is not None and self._process.stdin is not None
            await self._process.stdin.drain()
            answer = await asyncio.wait_for(future, self.timeout_s + self.answer_grace_s)
        except TimeoutError:
            self.lost = (
                f"timed out after {self.timeout_s:g}s and its process did not answer "
                "(synchronous code blocking the event loop?); the sandbox was restarted"
            )
            await self._kill()
            return self._failure(output_type, self.lost, started, retry=False)
        except (ConnectionError, OSError):
            self._pending.pop(call_id, None)
            reason = self.lost or "its process exited"
            return self._failure(output_type, reason, started, retry=self.retryable)
        except asyncio.CancelledError:  # nobody waits for it: the sandbox stops it, freeing its slot
            self._pending.pop(call_id, None)
            with contextlib.suppress(ConnectionError):
                self._send({"type": "cancel", "id": call_id})
            raise
        return self._validated(answer, output_type, started)

    def _validated(
        self, answer: dict[str, Any], output_type: type[BaseModel], started: float
    ) -> dict[str, Any]:
        try:
            output = output_type.model_validate(answer.get("output"))
        except ValidationError as exc:
            problem = str(exc).splitlines()[0]
            output = output_type.model_validate(
                {"status": "FAILED", "error": f"{self.component}: returned an invalid output ({problem})"}
            )
        spans = answer.get("spans")
        if not (isinstance(spans, list) and all(isinstance(s, dict) for s in spans)):
            spans = []
        return {"output": output, "spans": spans[:MAX_SPANS], "seconds": time.perf_counter() - started}

    def _failure(
        self, output_type: type[BaseModel], reason: str, started: float, *, retry: bool
    ) -> dict[str, Any]:
        output = output_type.model_validate({"status": "FAILED", "error": f"{self.component}: {reason}"})
        seconds = time.perf_counter() - started
        return {"output": output, "spans": [], "seconds": seconds, "lost": reason, "retry": retry}

    # -- resources and teardown -----------------------------------------------------------------------
    def resident_mb(self) -> float:
        """Memory of the sandbox's whole process tree, MB: its cgroup's charge where it has one, else
        the sum of its processes' resident sets (which counts pages the processes share once each)."""
        if self._process is None or self._process.returncode is not None:
            return 0.0
        charged = self.limits.memory_used_mb() if self.limits is not None else None
        if charged is not None:
            return charged
        try:
            root = psutil.Process(self._process.pid)
            tree = [root, *descendants(root)]
        except psutil.Error:
            return 0.0
        total = 0
        for process in tree:
            with contextlib.suppress(psutil.Error):
                total += process.memory_info().rss
        return total / MB

    async def _kill(self) -> None:
        if self._process is not None and self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, 9)
        if self.limits is not None:
            self.limits.kill_all()

    async def close(self) -> None:
        if self.lost is None:
            self.lost = "closed"
        await self._kill()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._reader, 10)
        for relay in self._relays:
            relay.close()
        shutil.rmtree(self.control_dir, ignore_errors=True)
