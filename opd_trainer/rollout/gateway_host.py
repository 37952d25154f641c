"""A job's recording gateways in one actor process, and a handle to one of them.

Every `Gateway` loads vLLM's request types and tool-call parser (an import of vLLM: about 11 CPU-seconds
on the CI machine's cores). A job that validates, or serves the teacher to its processors, runs two
(the student's and the teacher's); in two actors it paid that import twice at every start.
`GatewayHost` keeps a job's gateways on one actor's event loop, each with its own HTTP server (its own
port, keys and records), so nothing a processor or the driver sees changes but the process count.

`EngineWithGateways` is a vLLM engine whose actor process hosts them instead: a job that starts its own
teacher engine puts its gateways there (the teacher's process has imported vLLM already, and it is idle
while the student samples, which is when the gateways are busy), so a job start pays one vLLM import less.

`GatewayRef` is one model's gateway as the rollout runner uses it: open a step's keys, and the secret
that closes them over HTTP (`opd_trainer/recorded_calls.py`: whoever ran a rollout closes its key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.actor import ActorHandle

from opd_trainer.cluster.process_usage import actor_usage
from opd_trainer.engine.vllm_engine import Engine, EngineConfig
from opd_trainer.rollout.gateway import Gateway, RolloutKeyRequest


class GatewayHost:
    """Gateways by the model name each answers as (`Gateway.model_name`), on one event loop."""

    def __init__(self, models: dict[str, str], **options: Any) -> None:
        """A gateway per entry of `models` (the name it answers as -> the model's path, for its
        tokenizer), each with `Gateway`'s keyword `options`; engines come later (`set_engines`)."""
        self._gateways: dict[str, Gateway] = {}
        self._add(models, options)

    def _add(self, models: dict[str, str], options: dict[str, Any]) -> None:
        for name, path in models.items():
            if name in self._gateways:
                raise ValueError(f"a gateway for {name!r} is already here")
            self._gateways[name] = Gateway(name, path, [], **options)

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
        """`Gateway.set_engines` of `model_name`'s gateway."""
        self._gateway(model_name).set_engines(engines, client)

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


class EngineWithGateways(Engine, GatewayHost):
    """An `Engine` that can also host gateways (`host_gateways`), on the engine actor's event loop.

    One process: `usage` is the engine's (the gateways' CPU-seconds are in it), and `shutdown` stops
    the gateways' servers before the engine."""

    def __init__(self, config: EngineConfig, name: str = "engine") -> None:
        Engine.__init__(self, config, name)
        GatewayHost.__init__(self, {})

    async def host_gateways(self, models: dict[str, str], **options: Any) -> None:
        """Adds a gateway per entry of `models` (as `GatewayHost`) and loads their tool-call parsers."""
        self._add(models, options)
        await self.ready()

    async def usage(self) -> dict[str, float]:
        return await Engine.usage(self)

    async def shutdown(self) -> None:  # type: ignore[override]
        await GatewayHost.shutdown(self)
        Engine.shutdown(self)


EngineWithGatewaysActor = ray.remote(EngineWithGateways)
"""`EngineWithGateways` as a Ray actor (started like `EngineActor`, `vllm_engine.start_located_engines`)."""


@dataclass(frozen=True)
class GatewayRef:
    """One model's gateway inside a `GatewayHost` actor: the calls a rollout runner makes on it."""

    host: Any  # the GatewayHost actor's handle
    model_name: str

    async def open_rollouts(self, rollouts: list[RolloutKeyRequest]) -> list[str]:
        """A fresh key per rollout, in the order asked, in one Ray call (`Gateway.open_rollouts`)."""
        keys: list[str] = await self.host.open_rollouts.remote(self.model_name, rollouts)
        return keys

    async def close_secret(self) -> str:
        """The gateway's close secret (`GatewayHost.close_secret`)."""
        secret: str = await self.host.close_secret.remote(self.model_name)
        return secret
