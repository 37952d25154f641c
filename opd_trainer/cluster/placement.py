"""Waiting for Ray to place a job's actors, and saying what is missing when it cannot.

Ray queues an actor it cannot place (no node has the CPUs, GPUs or custom resource it asks for) and
waits, silently, for a node that may never come. Engines and learner ranks are placed first and
asked for their node (a method that answers only once the actor exists), before any model loads, so
a job that cannot be placed fails within `resources.placement_timeout_s`, naming the field that
sized the request and what the cluster has. The wait includes an autoscaler adding nodes.

Actors that only work together (the learner's data-parallel ranks) are reserved as one placement
group (`gang`): Ray places all of them or none, so two jobs cannot each hold half of the GPUs the
other needs, and PACK puts the ranks on as few nodes as fit (NCCL within a node).
"""

from __future__ import annotations

import asyncio

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from opd_trainer.errors import ConfigError


def gang(demand: dict[str, float], count: int) -> PlacementGroup:
    """A placement group of `count` bundles of `demand` each (zero amounts dropped), packed."""
    bundle = {name: amount for name, amount in demand.items() if amount}
    return placement_group([bundle] * count, strategy="PACK")


def in_gang(group: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    """Schedules an actor into bundle `index` of `group`."""
    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)


async def placed(
    actors: list[ActorHandle],
    *,
    what: str,
    demand: dict[str, float],
    field: str,
    timeout_s: float,
    group: PlacementGroup | None = None,
) -> list[str]:
    """The Ray node id of each actor (each must have a `node_id` method) once Ray has placed them all.

    Raises `ConfigError` naming `field` (and kills the actors, and removes their placement `group`)
    if they are not placed within `timeout_s`; `demand` is what each actor asks for, e.g.
    `{"CPU": 1, "GPU": 1}`."""
    try:
        nodes = await asyncio.wait_for(
            asyncio.gather(*(actor.node_id.remote() for actor in actors)), timeout_s
        )
    except TimeoutError:
        for actor in actors:
            ray.kill(actor)
        if group is not None:
            ray.util.remove_placement_group(group)
        asked = {name: amount for name, amount in demand.items() if amount}
        total, free = ray.cluster_resources(), ray.available_resources()
        wants = ", ".join(f"{amount:g} {name}" for name, amount in asked.items())
        has = ", ".join(f"{free.get(name, 0):g} of {total.get(name, 0):g} {name} free" for name in asked)
        together = f" (all {len(actors)} at once)" if group is not None and len(actors) > 1 else ""
        raise ConfigError(
            f"Ray could not place the {what}{together} within {timeout_s:g}s: each asks for {wants}; the "
            f"cluster has {has} (an autoscaler that is still adding nodes needs a longer "
            "resources.placement_timeout_s)",
            field=field,
        ) from None
    return list(nodes)
