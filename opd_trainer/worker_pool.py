"""Autoscaled pool of Ray actors that run one user processor component (shared by rollout and reward pools).

Each `ProcessorWorkerActor` loads the user's class by classpath from the component's workspace, runs
`setup()` once and then
up to `concurrency` `process` calls at once, each bounded by the component `timeout`. User failures are
contained: an exception or a timeout becomes a FAILED output, never a crashed job. A worker that dies is
replaced and its in-flight calls retried with `attempt_id + 1`, a bounded number of times.

The workspace travels as a zip through Ray's object store (so workers on any node get it; Ray refuses
local directories in per-actor runtime environments) and is unpacked into the worker's own folder,
which becomes its working directory. `requirements.txt` is installed by Ray's runtime environment
(`pip`), per component, together with the component's `env`.

`WorkerPool` places workers, dispatches calls to the least-loaded one, queues when all are full, and asks
the shared `Autoscaler` every `autoscale_interval_s` how many workers it should have.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import tempfile
import time
import traceback
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import ray
from ray.exceptions import RayActorError, RuntimeEnvSetupError

from opd_trainer.autoscaler import Autoscaler, AutoscalerSettings, PoolSnapshot
from opd_trainer.errors import ProcessorLoadError
from opd_trainer.job_spec import FunctionComponent

logger = logging.getLogger(__name__)

Kind = Literal["rollout", "reward"]
MAX_ATTEMPTS = 3
MB = 1024 * 1024


class ProcessorWorker:
    """Runs inside one actor whose working directory is the component's workspace."""

    def __init__(
        self,
        workspace_zip: bytes,
        classpath: str,
        kind: Kind,
        component: str,
        concurrency: int,
        timeout_s: float,
        memory_limit_mb: int,
    ) -> None:
        self.workspace = Path(tempfile.mkdtemp(prefix=f"opd-{component}-"))
        unpack_workspace(workspace_zip, self.workspace)
        # User code may open files relative to its workspace, as it would on Bailian.
        os.chdir(self.workspace)
        self.classpath = classpath
        self.kind = kind
        self.component = component
        self.timeout_s = timeout_s
        self.memory_limit_mb = memory_limit_mb
        self._slots = asyncio.Semaphore(concurrency)
        self._in_flight = 0
        self._processor: Any = None

    def load(self) -> str:
        """Imports and sets up the user's class; raises `ProcessorLoadError` with the user's traceback."""
        from opd_trainer.classpath import instantiate_processor, load_processor_class
        from opd_trainer.tracing import configure_tracing, ensure_observed

        if self._processor is None:
            configure_tracing(f"opd-{self.kind}-worker")
            # One workspace per worker process: no isolation, so lazy imports inside process() work.
            cls = load_processor_class(
                Path.cwd(), self.classpath, self.kind, component=self.component, isolate=False
            )
            self._processor = ensure_observed(instantiate_processor(cls, component=self.component))
        return type(self._processor).__name__

    def _failed(self, message: str) -> Any:
        from opd_trainer.sdk import RewardOutput, RolloutOutput, TaskStatus

        output_type = RolloutOutput if self.kind == "rollout" else RewardOutput
        return output_type(status=TaskStatus.FAILED, error=message)

    async def call(self, payload: Any, rollout_id: str) -> dict[str, Any]:
        """One `process` call; always returns {"output", "spans", "seconds"}, never raises for user faults."""
        from opd_trainer.sdk import call_processor
        from opd_trainer.tracing import collect_spans

        self.load()
        started = time.perf_counter()
        async with self._slots:
            self._in_flight += 1
            try:
                output = await asyncio.wait_for(call_processor(self._processor, payload), self.timeout_s)
            except TimeoutError:
                output = self._failed(f"{self.component}: timed out after {self.timeout_s:g}s")
            except Exception as exc:
                trace = "".join(traceback.format_exception(exc, limit=-6))
                output = self._failed(f"{self.component}: {type(exc).__name__}: {exc}\n{trace}")
            finally:
                self._in_flight -= 1
        return {
            "output": output,
            "spans": collect_spans(rollout_id),
            "seconds": time.perf_counter() - started,
        }

    def stats(self) -> dict[str, float]:
        import psutil

        rss_mb = psutil.Process(os.getpid()).memory_info().rss / MB
        return {"in_flight": float(self._in_flight), "memory_fraction": rss_mb / self.memory_limit_mb}


ProcessorWorkerActor = ray.remote(ProcessorWorker)


def pack_workspace(workspace: Path) -> bytes:
    """The workspace as zip bytes: a directory is zipped (skipping caches), a .zip is read as is."""
    if workspace.is_file():
        return workspace.read_bytes()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(workspace.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and not path.is_symlink():
                archive.write(path, path.relative_to(workspace).as_posix())
    return buffer.getvalue()


def unpack_workspace(data: bytes, target: Path) -> None:
    """Extracts only plain members that stay inside `target` (the server vetted uploads already)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for member in archive.infolist():
            destination = (target / member.filename).resolve()
            if not destination.is_relative_to(target.resolve()):
                raise ProcessorLoadError(f"workspace member {member.filename!r} escapes the workspace")
            archive.extract(member, target)


def requirements_of(workspace: Path) -> list[str]:
    """The requirement lines of the workspace's requirements.txt (dir or zip), comments dropped."""
    if workspace.is_file():
        with zipfile.ZipFile(workspace) as archive:
            names = set(archive.namelist())
            text = archive.read("requirements.txt").decode() if "requirements.txt" in names else ""
    else:
        file = workspace / "requirements.txt"
        text = file.read_text() if file.exists() else ""
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


def check_requirements_install(requirements: list[str], field: str, timeout_s: float = 300.0) -> None:
    """Resolves the requirements with `pip install --dry-run` before any worker starts.

    Ray builds a runtime environment by cloning the interpreter's whole virtualenv before running pip,
    and retries a failing install, so a typo in requirements.txt would cost minutes before it is seen;
    a dry run names the problem in seconds.
    """
    import subprocess
    import sys

    if not requirements:
        return
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--quiet",
        "--disable-pip-version-check",
        *requirements,
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ProcessorLoadError(
            f"requirements.txt could not be resolved within {timeout_s:.0f}s", field=field
        ) from None
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")] or [
            result.stderr[-800:]
        ]
        raise ProcessorLoadError("requirements.txt failed to install: " + " ".join(errors), field=field)


def runtime_env_for(component: FunctionComponent, workspace: Path) -> dict[str, Any] | None:
    """Ray runtime environment of a component's workers: its pip requirements and env vars.

    None when there is neither, so Ray can reuse its already started worker processes.
    """
    env: dict[str, Any] = {}
    if component.runtime.env:
        env["env_vars"] = dict(component.runtime.env)
    requirements = requirements_of(workspace)
    if requirements:
        env["pip"] = {"packages": requirements, "pip_check": False}
    return env or None


class WorkerPool:
    """The workers of one component, scaled by the shared autoscaler."""

    def __init__(
        self,
        job_id: str,
        component: FunctionComponent,
        workspace: Path,
        *,
        autoscale_interval_s: float = 1.0,
        scale_down_cooldown_s: float = 30.0,
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.job_id = job_id
        self.component = component
        # An evaluator implements the reward interface (RewardInput -> RewardOutput).
        self.kind: Kind = "rollout" if component.type == "rollout" else "reward"
        self.workspace = workspace
        self.autoscale_interval_s = autoscale_interval_s
        self.autoscaler = Autoscaler(
            AutoscalerSettings.from_runtime(component.runtime, scale_down_cooldown_s=scale_down_cooldown_s),
            pool=f"{component.type}:{component.name}",
            job_id=job_id,
            on_event=on_event,
        )
        self._workers: list[Any] = []
        self._in_flight: dict[Any, int] = {}
        self._queued = 0
        self._free = asyncio.Condition()
        self._workspace_ref: Any = None
        self._autoscale_task: asyncio.Task[None] | None = None
        self.calls = 0
        self.failures = 0
        self.retries = 0
        self.history: list[dict[str, Any]] = []

    @property
    def field(self) -> str:
        return f"functions.{self.component.name}.fcmodel"

    async def _new_worker(self) -> Any:
        runtime = self.component.runtime
        worker = ProcessorWorkerActor.options(  # type: ignore[attr-defined]
            num_cpus=runtime.cpu,
            memory=runtime.memory_size * MB,
            runtime_env=runtime_env_for(self.component, self.workspace),
            max_concurrency=max(16, runtime.concurrency * 2),
        ).remote(
            self._workspace_ref,
            self.component.fcmodel.classpath,
            self.kind,
            self.component.name,
            runtime.concurrency,
            self.component.timeout,
            runtime.memory_size,
        )
        try:
            await worker.load.remote()
        except RuntimeEnvSetupError as exc:
            ray.kill(worker)
            raise ProcessorLoadError(
                f"the workspace's requirements.txt failed to install: {str(exc)[-1500:]}", field=self.field
            ) from None
        except ProcessorLoadError:
            ray.kill(worker)
            raise
        self._workers.append(worker)
        self._in_flight[worker] = 0
        return worker

    async def start(self) -> None:
        """Starts `capacity` workers (at least one: load errors surface before training) + the autoscaler."""
        await asyncio.to_thread(check_requirements_install, requirements_of(self.workspace), self.field)
        self._workspace_ref = ray.put(pack_workspace(self.workspace))
        initial = max(1, self.autoscaler.initial_workers())
        await asyncio.gather(*(self._new_worker() for _ in range(initial)))
        self._autoscale_task = asyncio.get_running_loop().create_task(self._autoscale_loop())

    async def _acquire(self) -> Any:
        concurrency = self.component.runtime.concurrency
        async with self._free:
            self._queued += 1
            try:
                while True:
                    ready = [w for w in self._workers if self._in_flight[w] < concurrency]
                    if ready:
                        worker = min(ready, key=self._in_flight.__getitem__)
                        self._in_flight[worker] += 1
                        return worker
                    await self._free.wait()
            finally:
                self._queued -= 1

    async def _release(self, worker: Any) -> None:
        async with self._free:
            if worker in self._in_flight:
                self._in_flight[worker] -= 1
            self._free.notify_all()

    async def _replace(self, dead: Any) -> None:
        async with self._free:
            if dead in self._in_flight:
                self._workers.remove(dead)
                del self._in_flight[dead]
        logger.warning("[%s] %s worker died; starting a replacement", self.job_id, self.component.name)
        await self._new_worker()
        async with self._free:
            self._free.notify_all()

    async def run(self, make_payload: Callable[[int], Any], rollout_id: str) -> dict[str, Any]:
        """Runs one call; `make_payload(attempt_id)` builds the input. Retries on worker death."""
        for attempt in range(MAX_ATTEMPTS):
            worker = await self._acquire()
            try:
                result = await worker.call.remote(make_payload(attempt), rollout_id)
            except RayActorError:
                await self._release(worker)
                self.retries += 1
                await self._replace(worker)
                continue
            await self._release(worker)
            self.calls += 1
            result["attempt_id"] = attempt
            return result
        self.calls += 1
        self.failures += 1
        from opd_trainer.sdk import RewardOutput, RolloutOutput, TaskStatus

        output_type = RolloutOutput if self.kind == "rollout" else RewardOutput
        message = f"{self.component.name}: worker died {MAX_ATTEMPTS} times"
        return {
            "output": output_type(status=TaskStatus.FAILED, error=message),
            "spans": [],
            "seconds": 0.0,
            "attempt_id": MAX_ATTEMPTS - 1,
        }

    async def _snapshot(self) -> PoolSnapshot:
        stats = await asyncio.gather(*(w.stats.remote() for w in self._workers), return_exceptions=True)
        memory = [s["memory_fraction"] for s in stats if isinstance(s, dict)]
        in_flight = sum(self._in_flight.values())
        idle = sum(1 for w in self._workers if self._in_flight[w] == 0)
        return PoolSnapshot(
            len(self._workers), in_flight, self._queued, idle, max(memory) if memory else None
        )

    async def autoscale_once(self) -> None:
        decision = self.autoscaler.decide(await self._snapshot())
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
                *(self._new_worker() for _ in range(decision.desired - decision.current)),
                return_exceptions=True,
            )
        elif decision.action == "down":
            async with self._free:
                idle = [w for w in self._workers if self._in_flight[w] == 0][: decision.remove]
                for worker in idle:
                    self._workers.remove(worker)
                    del self._in_flight[worker]
            for worker in idle:
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
        for worker in self._workers:
            ray.kill(worker)
        self._workers.clear()
        self._in_flight.clear()
        self.autoscaler.remove_labels()
