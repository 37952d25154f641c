"""One test body for both clients: `OPDClient` and `AsyncOPDClient` over `httpx.MockTransport`, the
async one driven from synchronous test code (each call awaited, each async iterator collected)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from opd_trainer.client import AsyncOPDClient, OPDClient
from opd_trainer.wire.schemas import JobPublic

KINDS = ("sync", "async")
Handler = Callable[[httpx.Request], httpx.Response]


class Synced:
    """An `AsyncOPDClient` whose methods return their awaited results (async iterators as lists)."""

    def __init__(self, client: AsyncOPDClient, loop: asyncio.AbstractEventLoop) -> None:
        self._client = client
        self._loop = loop

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._client, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            if inspect.isawaitable(result):
                return self._loop.run_until_complete(result)
            if isinstance(result, AsyncIterator):
                return self._loop.run_until_complete(_collect(result))
            return result

        return call


async def _collect(items: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in items]


@contextmanager
def client(kind: str, handler: Handler, **options: Any) -> Iterator[Any]:
    """An `OPDClient` (kind `sync`) or a `Synced` `AsyncOPDClient` whose server is `handler`."""
    transport = httpx.MockTransport(handler)
    if kind == "sync":
        with OPDClient("http://opd.test", "key", transport=transport, **options) as sync:
            yield sync
        return
    loop = asyncio.new_event_loop()
    async_client = AsyncOPDClient("http://opd.test", "key", transport=transport, **options)
    try:
        yield Synced(async_client, loop)
    finally:
        loop.run_until_complete(async_client.close())
        loop.close()


def record_sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Both clients' sleeps (retry backoff, reconnects, polling) recorded instead of slept."""
    slept: list[float] = []

    async def async_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setattr(asyncio, "sleep", async_sleep)
    return slept


def job_json(job_id: str = "opdjob-1", status: str = "queued", **fields: Any) -> dict[str, Any]:
    """A job as the server sends it."""
    job = JobPublic(id=job_id, job_name="j", status=status, created_at=1, spec={"job_name": "j"}, **fields)
    return job.model_dump(mode="json")
