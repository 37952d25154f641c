"""Teacher engines shared by jobs: owned by the service, not by a job.

A teacher is frozen, so two jobs distilling from the same teacher can score on the same engines. With
sharing on (the job server's `OPD_SHARED_TEACHER_IDLE_S`), a job asks the `SharedTeachers` registry, a
detached Ray actor of the cluster, for its teacher's engines instead of starting its own:

- **Keyed by what makes engines the same**: the model folder (resolved), context length, dtype and
  placement (`resources.teacher`), eagerness, CPU slots and the top-k limit (`sharing_key`). The first
  job's settings start the engines; the others join them.
- **Reference-counted**: each job holds the engines it acquired until it releases them (its driver
  stops: finished, failed, cancelled, paused) or its driver actor dies (checked every `idle_s / 2`).
  Engines nobody has held for `idle_s` seconds are shut down.
- **Fair between jobs**: every request names its job, and each engine admits at most its concurrency
  at once, handing freed slots to the jobs in turn (`engine/fair_gate.py`): one job's burst waits
  behind the other's queued work instead of starving it.
- **Metered per job**: a job's teacher tokens are its own requests', and the engines' CPU/GPU are split
  among the jobs by the tokens each scored (`Engine.client_usage`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from opd_trainer.engine.vllm_engine import EngineConfig, EngineGroup, start_located_engines

REGISTRY_NAME = "opd-shared-teachers"
REGISTRY_NAMESPACE = "opd-shared-teachers"
HOLDER_CHECK_TIMEOUT_S = 30.0


def sharing_key(config: EngineConfig) -> str:
    """Which engines a teacher `config` can share: equal for configs whose engines would be the same
    (the per-job sampler seed, placement timeout and batch concurrency aside)."""
    fields = config.model_dump(
        mode="json",
        include={"model", "max_model_len", "resources", "enforce_eager", "num_cpus", "max_logprobs"},
    )
    fields["model"] = str(Path(config.model).resolve())
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass
class _Shared:
    model: str
    actors: list[ActorHandle]
    nodes: list[str]
    holders: dict[str, ActorHandle | None] = dataclasses.field(default_factory=dict)
    idle_since: float | None = None


class SharedTeachers:
    """The registry (a detached Ray actor, `registry`): engines by `sharing_key`, who holds them."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.groups: dict[str, _Shared] = {}
        self.locks: dict[str, asyncio.Lock] = {}
        self.started = 0  # engine groups started over the registry's life
        self._watch: asyncio.Task[None] | None = None

    async def acquire(
        self, job_id: str, config: EngineConfig, holder: ActorHandle | None
    ) -> tuple[list[ActorHandle], list[str]]:
        """The engines for `config` (started now if none run), held by `job_id` until `release`;
        `holder`: the job's driver actor, whose death releases them too. Returns actors and nodes."""
        key = sharing_key(config)
        async with self.locks.setdefault(key, asyncio.Lock()):
            shared = self.groups.get(key)
            if shared is None:
                actors, nodes = await start_located_engines(config, "teacher")
                shared = self.groups[key] = _Shared(config.model, actors, nodes)
                self.started += 1
            shared.holders[job_id] = holder
            shared.idle_since = None
        if self._watch is None:
            self._watch = asyncio.create_task(self._watch_holders())
        return shared.actors, shared.nodes

    async def release(self, job_id: str) -> None:
        """`job_id` no longer holds any engines; engines idle past `idle_s` are shut down."""
        for shared in self.groups.values():
            if shared.holders.pop(job_id, ...) is not ... and not shared.holders:
                shared.idle_since = time.monotonic()
        await self._shut_idle()

    async def state(self) -> dict[str, Any]:
        """What runs: `engine_groups_started` over the registry's life, and each group's model,
        replicas and holders."""
        return {
            "engine_groups_started": self.started,
            "groups": [
                {"key": key, "model": s.model, "replicas": len(s.actors), "holders": sorted(s.holders)}
                for key, s in self.groups.items()
            ],
        }

    async def _shut_idle(self) -> None:
        now = time.monotonic()
        for key, shared in list(self.groups.items()):
            if shared.holders or shared.idle_since is None or now - shared.idle_since < self.idle_s:
                continue
            del self.groups[key]
            await EngineGroup(shared.actors).shutdown()

    async def _watch_holders(self) -> None:
        """Every `idle_s / 2` (at least 1 s): holders whose driver died are released, idle engines end."""
        while True:
            await asyncio.sleep(max(1.0, self.idle_s / 2))
            for shared in list(self.groups.values()):
                for job_id, holder in list(shared.holders.items()):
                    if holder is not None and not await _alive(holder):
                        await self.release(job_id)
            await self._shut_idle()


async def _alive(actor: ActorHandle) -> bool:
    try:
        await asyncio.wait_for(actor.__ray_ready__.remote(), HOLDER_CHECK_TIMEOUT_S)
    except (RayActorError, TimeoutError):
        return False
    return True


def registry(idle_s: float) -> ActorHandle:
    """The cluster's registry, created on first use (`idle_s`: the first creator's)."""
    return (
        ray.remote(SharedTeachers)
        .options(  # type: ignore[attr-defined]
            name=REGISTRY_NAME,
            namespace=REGISTRY_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=1000,
        )
        .remote(idle_s)
    )


async def acquire_shared(
    registry_actor: ActorHandle, job_id: str, config: EngineConfig, holder: ActorHandle | None
) -> EngineGroup:
    """The shared engines for `config`, as this job's group (its requests and metering its own)."""
    actors, nodes = await registry_actor.acquire.remote(job_id, config, holder)
    return EngineGroup(actors, nodes, client=job_id)
