"""Engines shared by jobs: owned by the service, not by a job.

A teacher is frozen, so two jobs distilling from the same teacher can score on the same engines. A
LoRA job's student never changes its base weights either (each job trains an adapter, served as a
`LoRARequest` of its own: `engine/adapters.py`), so LoRA jobs on the same base model can sample on the
same student engines, each with its own adapter. With sharing on (the job server's
`OPD_SHARED_TEACHER_IDLE_S` / `OPD_SHARED_STUDENT_IDLE_S`: an `EngineSharing` per role), a job asks the
role's `SharedEngines` registry, a detached Ray actor of the cluster, for those engines instead of
starting its own (a full-training job's student is never shared: its weights change). The job's side
(acquiring, releasing) and the start and stop of replicas are `engine/fleet.py`'s:

- **Keyed by what makes engines the same**: the model folder (resolved), context length, dtype and
  placement (`resources.<role>`), eagerness, CPU slots, the top-k limit and, for students, the LoRA
  rank vLLM serves (`sharing_key`: the smallest `max_lora_rank` it accepts that covers the job's `r`,
  so jobs of ranks 4 and 8 share). The first job's settings start the engines; the others join them.
- **Adapters per job** (students): a student group serves at most `max_jobs` jobs (vLLM's `max_loras`
  is that plus one, for an update's swap: `shared_config`); a job past it starts another group. Each
  job's requests and adapter updates name it (`EngineGroup.client`), so it samples with its own
  adapter and records its own adapter's version, and another job's update never holds its sampling.
  A job's adapter is unloaded when it releases the group (`Engine.drop_adapter`).
- **Reference-counted**: each job holds the engines it acquired until it releases them (its driver
  stops: finished, failed, cancelled, paused) or its driver actor dies (checked every `check_s`).
  Engines nobody has held for `idle_s` seconds are shut down.
- **Scaled by load** (teachers): every `check_s` the registry reads each replica's load
  (`Engine.load`); a group whose requests wait for a slot two checks in a row gets a replica more (up
  to `max_replicas`), one with nothing to do for five checks gives back a replica it added
  (`engine_sharing.LoadStreak`). A job's group (`SharedEngineGroup`) reads the current replicas
  before it sends requests, so a new replica takes work at once, and a removed one is shut down
  `DRAIN_S` later, once its last requests ended. A student group keeps its first job's replicas.
- **Fair between jobs**: every request names its job, and each engine admits at most its concurrency
  at once, handing freed slots to the jobs in turn (`engine/fair_gate.py`): one job's burst waits
  behind the other's queued work instead of starving it.
- **Metered per job**: a job's tokens are its own requests' (scored or sampled), and the engines'
  CPU/GPU are split among the jobs by the tokens each scored or sampled (`Engine.client_usage`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from opd_trainer.engine.adapters import served_rank
from opd_trainer.engine.engine_sharing import EngineSharing, LoadStreak
from opd_trainer.engine.engine_stats import combine
from opd_trainer.engine.vllm_engine import EngineConfig, EngineGroup

REGISTRY_NAMESPACE = "opd-shared-engines"
HOLDER_CHECK_TIMEOUT_S = 30.0
REFRESH_S = 1.0
"""How long a job's `SharedEngineGroup` uses its list of replicas before asking again."""
DRAIN_S = 120.0
"""How long a replica given back stays up, idle, before it is shut down: jobs that sent to it read
their counts from it meanwhile (every step); what a job has not read by then is not metered."""


def sharing_key(config: EngineConfig) -> str:
    """Which engines `config` can share: equal for configs whose engines would be the same (the per-job
    sampler seed, placement timeout and batch concurrency aside; LoRA ranks that vLLM serves alike)."""
    fields = config.model_dump(
        mode="json",
        include={"model", "max_model_len", "resources", "enforce_eager", "num_cpus", "max_logprobs"},
    )
    fields["model"] = str(Path(config.model).resolve())
    if config.lora_rank is not None:
        fields["lora_rank"] = served_rank(config.lora_rank)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def shared_config(config: EngineConfig, sharing: EngineSharing) -> EngineConfig:
    """The config a shared group starts with, from its first job's: a LoRA student serves the rank its
    key names and one adapter per job it may hold, plus one for an update's swap."""
    if config.lora_rank is None:
        return config
    max_loras = (sharing.max_jobs or config.max_loras - 1) + 1
    return config.model_copy(update={"lora_rank": served_rank(config.lora_rank), "max_loras": max_loras})


class StartReplicas(Protocol):
    """`fleet.start_replicas`: places and starts `config`'s replicas named `NAME-i`; their nodes too."""

    async def __call__(self, config: EngineConfig, name: str) -> tuple[list[ActorHandle], list[str]]: ...


StopReplicas = Callable[[list[ActorHandle]], Awaitable[None]]
"""`fleet.stop_replicas`: shuts replicas down and ends their actors."""


@dataclasses.dataclass
class _Shared:
    key: str  # its `sharing_key`; several groups have the same one when each holds `max_jobs` jobs
    config: EngineConfig
    actors: list[ActorHandle]
    nodes: list[str]
    holders: dict[str, ActorHandle | None] = dataclasses.field(default_factory=dict)
    idle_since: float | None = None
    version: int = 0  # bumped whenever the replicas change
    streak: LoadStreak = dataclasses.field(default_factory=LoadStreak)
    growing: asyncio.Task[None] | None = None  # a replica being added
    draining: list[tuple[ActorHandle, float]] = dataclasses.field(default_factory=list)  # (replica, since)


class SharedEngines:
    """The registry of one role's shared engines (a detached Ray actor, `fleet.shared_registry`): engine
    groups by `sharing_key`, who holds them. `start` / `stop`: how it starts and stops replicas
    (`fleet.start_replicas` / `fleet.stop_replicas`)."""

    def __init__(
        self, sharing: EngineSharing, role: str, *, start: StartReplicas, stop: StopReplicas
    ) -> None:
        self.sharing = sharing
        self.role = role
        self._start, self._stop = start, stop
        self.groups: dict[str, _Shared] = {}  # by group id: `sharing_key`.n
        self.locks: dict[str, asyncio.Lock] = {}
        self.started = 0  # engine groups started over the registry's life
        self.replicas_added = 0  # replicas added to running groups under load
        self.replicas_removed = 0  # ... and given back when load fell
        self._watch: asyncio.Task[None] | None = None

    async def acquire(
        self, job_id: str, config: EngineConfig, holder: ActorHandle | None
    ) -> tuple[str, list[ActorHandle], list[str]]:
        """The engines for `config` (started now if no group with room runs), held by `job_id` until
        `release`; `holder`: the job's driver actor, whose death releases them too. Returns the group's
        id, its replicas and their nodes."""
        key = sharing_key(config)
        async with self.locks.setdefault(key, asyncio.Lock()):
            await self._retire_broken(key)
            found = [
                (group_id, s) for group_id, s in self.groups.items() if s.key == key and self._room(s, job_id)
            ]
            if found:
                group_id, shared = found[0]
            else:
                config = shared_config(config, self.sharing)
                actors, nodes = await self._start(config, self.role)
                group_id = f"{key}.{self.started}"
                shared = self.groups[group_id] = _Shared(key, config, actors, nodes)
                self.started += 1
            shared.holders[job_id] = holder
            shared.idle_since = None
        if self._watch is None:
            self._watch = asyncio.create_task(self._watch_loop())
        return group_id, list(shared.actors), list(shared.nodes)

    async def _retire_broken(self, key: str) -> None:
        """Drops the groups for `key` with a replica Ray says died (a job recovering from its loss,
        `driver/recovery.py`, must not be handed it again): their live replicas are shut down, and the
        jobs still holding them fail their next request and recover onto a new group."""
        for group_id, shared in list(self.groups.items()):
            if shared.key != key:
                continue
            alive = await asyncio.gather(*(_alive(actor) for actor in shared.actors))
            if all(alive):
                continue
            del self.groups[group_id]
            await self._stop([a for a, up in zip(shared.actors, alive, strict=True) if up])

    def _room(self, shared: _Shared, job_id: str) -> bool:
        """Whether `job_id` may hold `shared`: it does already, or the group holds fewer than `max_jobs`."""
        limit = self.sharing.max_jobs
        return job_id in shared.holders or limit is None or len(shared.holders) < limit

    async def replicas(self, group_id: str) -> list[ActorHandle]:
        """The group's current replicas (a job's `SharedEngineGroup` asks every `REFRESH_S`)."""
        shared = self.groups.get(group_id)
        return list(shared.actors) if shared is not None else []

    async def release(self, job_id: str) -> None:
        """`job_id` no longer holds any engines: its adapters are unloaded from a student group's
        replicas (`Engine.drop_adapter`), and engines idle past `idle_s` are shut down."""
        for shared in list(self.groups.values()):
            if shared.holders.pop(job_id, ...) is ...:
                continue
            if shared.config.lora_rank is not None:
                drops = (actor.drop_adapter.remote(job_id) for actor in shared.actors)
                await asyncio.gather(*drops, return_exceptions=True)  # a dead replica has nothing loaded
            if not shared.holders:
                shared.idle_since = time.monotonic()
        await self._shut_idle()

    async def state(self) -> dict[str, Any]:
        """What runs: groups started and replicas added / removed over the registry's life, and each
        group's model, replicas and holders."""
        return {
            "engine_groups_started": self.started,
            "replicas_added": self.replicas_added,
            "replicas_removed": self.replicas_removed,
            "groups": [
                {"key": key, "model": s.config.model, "replicas": len(s.actors), "holders": sorted(s.holders)}
                for key, s in self.groups.items()
            ],
        }

    async def _shut_idle(self) -> None:
        now = time.monotonic()
        for key, shared in list(self.groups.items()):
            if shared.holders or shared.idle_since is None or now - shared.idle_since < self.sharing.idle_s:
                continue
            del self.groups[key]
            actors = shared.actors + [actor for actor, _ in shared.draining]
            await self._stop(actors)

    async def _watch_loop(self) -> None:
        """Every `check_s`: holders whose driver died are released, idle groups end, groups scale."""
        while True:
            await asyncio.sleep(self.sharing.check_s)
            for shared in list(self.groups.values()):
                for job_id, holder in list(shared.holders.items()):
                    if holder is not None and not await _alive(holder):
                        await self.release(job_id)
            await self._shut_idle()
            for shared in list(self.groups.values()):
                await self._scale(shared)
                await self._end_drained(shared)

    async def _scale(self, shared: _Shared) -> None:
        low = shared.config.resources.replicas
        high = max(low, self.sharing.max_replicas or low)
        if shared.config.lora_rank is not None:
            high = low  # a replica added now would not hold the jobs' adapters
        if shared.growing is not None or high == low:
            return
        try:
            loads = list(await asyncio.gather(*(actor.load.remote() for actor in shared.actors)))
        except RayActorError:
            return  # a replica died: the jobs using it fail over on their own; nothing to scale by
        step = shared.streak.scale(loads, len(shared.actors), low, high)
        if step > 0:
            shared.growing = asyncio.create_task(self._grow(shared))
        elif step < 0:
            shared.draining.append((shared.actors.pop(), time.monotonic()))
            shared.nodes.pop()
            shared.version += 1
            self.replicas_removed += 1

    async def _grow(self, shared: _Shared) -> None:
        one = shared.config.resources.model_copy(update={"replicas": 1})
        try:
            actors, nodes = await self._start(shared.config.model_copy(update={"resources": one}), self.role)
        except Exception:  # no room on the cluster now: the next busy checks try again
            shared.growing = None
            return
        shared.actors += actors
        shared.nodes += nodes
        shared.version += 1
        shared.growing = None
        self.replicas_added += 1

    async def _end_drained(self, shared: _Shared) -> None:
        """Shuts down removed replicas once no job can still be sending to them and the jobs had time
        to read their counts from them (`DRAIN_S`), and their last requests ended."""
        now = time.monotonic()
        for actor, since in list(shared.draining):
            if now - since < DRAIN_S:
                continue
            try:
                load = await actor.load.remote()
            except RayActorError:
                load = {"in_flight": 0.0, "queued": 0.0}
            if load["in_flight"] + load["queued"] == 0:
                shared.draining.remove((actor, since))
                await self._stop([actor])


async def _alive(actor: ActorHandle) -> bool:
    """False once Ray says the actor died; a busy one that does not answer in time counts as alive."""
    try:
        await asyncio.wait_for(actor.__ray_ready__.remote(), HOLDER_CHECK_TIMEOUT_S)
    except RayActorError:
        return False
    except TimeoutError:
        return True
    return True


class SharedEngineGroup(EngineGroup):
    """A job's view of a shared group: its requests name the job (fair admission, its own metering),
    and the replicas are re-read from the registry every `REFRESH_S`, so it follows the group as it
    grows and shrinks. Its stats and usage add up every replica it has used."""

    def __init__(self, registry_actor: ActorHandle, key: str, job_id: str, actors: list[ActorHandle]) -> None:
        super().__init__(actors, client=job_id)
        self.registry, self.key = registry_actor, key
        self._refreshed = time.monotonic()
        self._used = list(actors)  # every replica this job has sent to
        self._last: dict[tuple[str, int], dict[str, float]] = {}  # (what, replica index) -> last reading

    async def _fan_out(
        self, items: list[Any], call: Callable[[ActorHandle, list[Any]], Awaitable[list[Any]]]
    ) -> list[Any]:
        if time.monotonic() - self._refreshed > REFRESH_S:
            current = await self.registry.replicas.remote(self.key)
            if current:
                self.actors = current
                self._used += [actor for actor in current if actor not in self._used]
            self._refreshed = time.monotonic()
        return await super()._fan_out(items, call)

    async def _readings(self, what: str) -> list[dict[str, float]]:
        """Every used replica's `client_stats` / `client_usage`; a replica shut down since keeps its
        last reading, so the job's totals never fall."""

        async def one(index: int, actor: ActorHandle) -> dict[str, float]:
            try:
                reading: dict[str, float] = await getattr(actor, what).remote(self.client)
            except RayActorError:
                return self._last.get((what, index), {})
            self._last[(what, index)] = reading
            return reading

        return list(await asyncio.gather(*(one(i, actor) for i, actor in enumerate(self._used))))

    async def stats(self) -> dict[str, float]:
        return combine(await self._readings("client_stats"))

    async def usage(self) -> dict[str, float]:
        readings = [r for r in await self._readings("client_usage") if r]
        return {key: float(sum(r.get(key, 0.0) for r in readings)) for key in readings[0]}
