"""Where a job's gateways run: a policy of the rollout package, applied to the engines the job holds.

Rollouts sample through the student's gateway, so its gateways (the student's, and the default
teacher's when the job validates or serves it to processors) run in the process of the student's first
engine replica, a service of that engine (`Engine.host`, `engine/hosting.py`): a gateway request
samples on that replica in-process, with no Ray call (`gateway_host.LocalReplica`), and on the other
replicas by Ray. That process has imported vLLM already, so the gateways cost no import of their own.
vLLM samples on a thread of its own there (`engine/inproc_llm.py`), so the gateways' work on the
engine's event loop does not stop the sampling, and a weight update holds their requests as any other
(`Engine.sample`'s version gate).

A student whose engines other jobs share (LoRA jobs on one base model, `engine/shared_engines.py`) is
not the job's to host in: its gateways then run in an actor of their own (`GatewayHostActor`), started
beside the driver as soon as the job starts, so its import of vLLM overlaps the engines' start.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from opd_trainer.rollout.gateway_host import GatewayHost, GatewayHostActor, GatewayRef

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from opd_trainer.engine.vllm_engine import Engine, EngineGroup

GATEWAYS_SERVICE = "gateways"
"""The name a job's `GatewayHost` has as a service of the student engine that hosts it."""


def start_own_process(models: dict[str, str], options: dict[str, Any]) -> ActorHandle:
    """A gateway host process of its own (a job on a shared student), on this driver's node: a
    zero-CPU actor fits anywhere, and one Ray put on a worker node would take the job down with that
    node (seen in CI: a gateway landed on the processor pools' node, killed)."""
    this_node = ray.get_runtime_context().get_node_id()
    beside_the_driver = NodeAffinitySchedulingStrategy(this_node, soft=False)
    return GatewayHostActor.options(  # type: ignore[attr-defined]
        num_cpus=0, scheduling_strategy=beside_the_driver
    ).remote(models, **options)


async def host_in_engine(engine: Engine, models: dict[str, str], options: dict[str, Any]) -> GatewayHost:
    """The builder an engine runs in its own process (`Engine.host`): the gateways, with that engine
    as their in-process replica, their tool-call parsers loaded (a bad parser name fails here)."""
    host = GatewayHost(models, engine, **options)
    await host.ready()
    return host


@dataclasses.dataclass(frozen=True)
class PlacedGateways:
    """Where a job's gateways run: an actor of their own (`service` None) or an engine hosting them."""

    actor: ActorHandle
    service: str | None

    def ref(self, model_name: str) -> GatewayRef:
        """`model_name`'s gateway, as the rollout runner calls it."""
        return GatewayRef(self.actor, model_name, self.service)

    async def serve(self, model_name: str, engines: EngineGroup) -> str:
        """Hands `model_name`'s gateway its engines (and the job's name on them, when shared: every call
        names it) and starts its HTTP server; returns the base URL."""
        gateway = self.ref(model_name)
        await gateway.call("set_engines", model_name, engines.actors, engines.client)
        # On a cluster the rollout workers may sit on other nodes: listen on every interface there.
        single_node = sum(1 for node in ray.nodes() if node.get("Alive")) <= 1
        url: str = await gateway.call("serve", model_name, "127.0.0.1" if single_node else "0.0.0.0")
        return url


async def place_gateways(
    models: dict[str, str], options: dict[str, Any], student: EngineGroup, own_process: ActorHandle | None
) -> PlacedGateways:
    """The job's gateways (`models`: the name each answers as -> its model, `options`: `Gateway`'s) in
    the student's first engine replica, or in `own_process` (`start_own_process`) when the job has one
    because its student is shared."""
    if own_process is not None:
        await own_process.ready.remote()  # vLLM's tool-call parsers load; a bad parser name fails here
        return PlacedGateways(own_process, None)
    engine = student.actors[0]
    await engine.host.remote(GATEWAYS_SERVICE, host_in_engine, models, options)
    return PlacedGateways(engine, GATEWAYS_SERVICE)
