"""Services another package runs in an engine's process, on its event loop (`Engine.host`).

The engine knows nothing of what it hosts: a service is whatever its builder returns, called by method
name (`call`) and stopped before the engine (`shutdown`). A hosted service reaches the engine that hosts
it in-process, as a plain object, with no Ray call; the rollout package places a job's gateways this way
(`rollout/gateway_placement.py`).
"""

from __future__ import annotations

import inspect
from typing import Any


class HostedServices:
    """An engine's hosted services, by name, in the order they were added."""

    def __init__(self) -> None:
        self._services: dict[str, Any] = {}

    async def add(self, name: str, service: Any) -> None:
        """Keeps `service` as `name` (an awaitable is awaited first: a builder may be async)."""
        if name in self._services:
            raise ValueError(f"a service {name!r} is hosted here already")
        self._services[name] = await service if inspect.isawaitable(service) else service

    async def call(self, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """`service.method(*args, **kwargs)` of the service `name`, awaited if it is a coroutine."""
        try:
            service = self._services[name]
        except KeyError:
            raise ValueError(f"no service {name!r} hosted here (have {sorted(self._services)})") from None
        result = getattr(service, method)(*args, **kwargs)
        return await result if inspect.isawaitable(result) else result

    async def shutdown(self) -> None:
        """Stops every service that has a `shutdown`, the last added first, and forgets them."""
        for service in reversed(list(self._services.values())):
            stop = getattr(service, "shutdown", None)
            if stop is not None:
                result = stop()
                if inspect.isawaitable(result):
                    await result
        self._services.clear()
