"""A job's recording gateways in one process, and a handle to one of them.

Every `Gateway` loads vLLM's request types and tool-call parser (an import of vLLM: about 11 CPU-seconds
on the CI machine's cores). A job that validates, or serves the teacher to its processors, runs two
(the student's and the teacher's), and in two actors each would pay that import at every start.
`GatewayHost` keeps a job's gateways on one event loop, each with its own HTTP server (its own port, keys
and records), so nothing a processor or the driver sees changes but the process count.

A host runs in a student engine's process (a service of the engine, `Engine.host`: the process has
imported vLLM already) or in an actor of its own (`GatewayHostActor`); `gateway_placement.py` decides.
A gateway reaches each engine replica as an `EngineReplica`: the engine whose process hosts it directly
(`LocalReplica`, an await on the `Engine` object, no Ray), the others by Ray (`RayReplica`).

`GatewayRef` is one model's gateway as the rollout runner uses it: open a step's keys, and the secret
that closes them over HTTP (`opd_trainer/recorded_calls.py`: whoever ran a rollout closes its key).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray.actor import ActorHandle

from opd_trainer.cluster.process_usage import actor_usage
from opd_trainer.rollout.gateway import EngineReplica, Gateway, RolloutKeyRequest

if TYPE_CHECKING:
    from ray import ObjectRef
    from vllm import SamplingParams

    from opd_trainer.engine.vllm_engine import Engine, Sampled, SampledText


@dataclass(frozen=True)
class LocalReplica:
    """The engine whose process hosts the gateway: called in-process, no Ray (its sampling runs on
    vLLM's own thread, `engine/inproc_llm.py`, or process, so the await does not hold the loop)."""

    engine: Engine

    async def sample(
        self, prompt_token_ids: list[int], params: SamplingParams, client: str | None
    ) -> Sampled:
        return await self.engine.sample(prompt_token_ids, params, client)

    def sample_stream(
        self, prompt_token_ids: list[int], params: SamplingParams, client: str | None
    ) -> AsyncIterator[SampledText | Sampled]:
        return self.engine.sample_stream(prompt_token_ids, params, client)


@dataclass(frozen=True)
class RayReplica:
    """An engine replica in another process: its actor, called by Ray."""

    actor: ActorHandle

    async def sample(
        self, prompt_token_ids: list[int], params: SamplingParams, client: str | None
    ) -> Sampled:
        sampled: Sampled = await self.actor.sample.remote(prompt_token_ids, params, client)
        return sampled

    async def sample_stream(
        self, prompt_token_ids: list[int], params: SamplingParams, client: str | None
    ) -> AsyncIterator[SampledText | Sampled]:
        """A Ray streaming generator (`num_returns="streaming"`): each piece as the engine yields it."""
        pieces = self.actor.sample_stream.options(num_returns="streaming").remote(
            prompt_token_ids, params, client
        )
        async for ref in pieces:
            yield await ref


class GatewayHost:
    """Gateways by the model name each answers as (`Gateway.model_name`), on one event loop."""

    def __init__(self, models: dict[str, str], engine: Engine | None = None, **options: Any) -> None:
        """A gateway per entry of `models` (the name it answers as -> the model's path, for its
        tokenizer), each with `Gateway`'s keyword `options`; engines come later (`set_engines`).
        `engine`: the engine whose process hosts these gateways, if any (called in-process)."""
        self._engine = engine
        self._gateways = {name: Gateway(name, path, [], **options) for name, path in models.items()}

    def _gateway(self, model_name: str) -> Gateway:
        try:
            return self._gateways[model_name]
        except KeyError:
            raise ValueError(f"no gateway for {model_name!r} here (have {sorted(self._gateways)})") from None

    async def ready(self) -> None:
        """Loads every gateway's tool-call parser (`Gateway.ready`: a bad parser fails here)."""
        for gateway in self._gateways.values():
            await gateway.ready()

    async def set_engines(
        self, model_name: str, engines: list[ActorHandle], client: str | None = None
    ) -> None:
        """`Gateway.set_engines` of `model_name`'s gateway: the engine actor this host runs in, if one
        of `engines`, as a `LocalReplica`, the others as `RayReplica`s."""
        self._gateway(model_name).set_engines([self._replica(actor) for actor in engines], client)

    def _replica(self, actor: ActorHandle) -> EngineReplica:
        if self._engine is not None and actor._actor_id.hex() == ray.get_runtime_context().get_actor_id():
            return LocalReplica(self._engine)
        return RayReplica(actor)

    async def serve(self, model_name: str, host: str = "127.0.0.1") -> str:
        """Starts `model_name`'s HTTP server; returns its `/v1` base URL (`Gateway.serve`)."""
        return await self._gateway(model_name).serve(host)

    def open_rollouts(self, model_name: str, rollouts: list[RolloutKeyRequest]) -> list[str]:
        return self._gateway(model_name).open_rollouts(rollouts)

    def close_secret(self, model_name: str) -> str:
        """What closes `model_name`'s keys over HTTP (`Gateway.close_secret`)."""
        return self._gateway(model_name).close_secret

    async def usage(self) -> dict[str, float]:
        """This process's CPU-seconds so far (all its gateways'), for metering."""
        return actor_usage()

    async def shutdown(self) -> None:
        for gateway in self._gateways.values():
            await gateway.shutdown()


GatewayHostActor = ray.remote(GatewayHost)
"""`GatewayHost` as a Ray actor; its gateways' HTTP servers run inside it."""


@dataclass(frozen=True)
class GatewayRef:
    """One model's gateway inside a `GatewayHost`: the calls a rollout runner makes on it."""

    host: Any  # the actor the GatewayHost runs in: a `GatewayHostActor`, or an engine hosting it
    model_name: str
    service: str | None = None  # the host's name as a service of that engine (`Engine.host`); None: own actor

    def call(self, method: str, *args: Any) -> ObjectRef[Any]:
        """`GatewayHost.<method>(*args)` by Ray, wherever the host runs."""
        if self.service is None:
            return getattr(self.host, method).remote(*args)
        return self.host.call_hosted.remote(self.service, method, *args)

    async def open_rollouts(self, rollouts: list[RolloutKeyRequest]) -> list[str]:
        """A fresh key per rollout, in the order asked, in one Ray call (`Gateway.open_rollouts`)."""
        keys: list[str] = await self.call("open_rollouts", self.model_name, rollouts)
        return keys

    async def close_secret(self) -> str:
        """The gateway's close secret (`GatewayHost.close_secret`)."""
        secret: str = await self.call("close_secret", self.model_name)
        return secret
