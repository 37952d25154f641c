"""Byte relays between two stream connections: how a sandbox reaches the job's gateway.

The sandbox has only loopback in its network namespace. Its worker listens on a Unix socket per
gateway (`serve_unix_to_tcp`, trusted side, outside) and the processor host listens on a loopback
port inside the sandbox that relays to that socket (`serve_tcp_to_unix`). A rollout's `base_url`
names the loopback port, so user code speaks plain HTTP to it, and the only peer it can reach is the
gateway the worker chose, where its per-rollout key is its only credential.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from typing import Any

CHUNK = 64 * 1024


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass


async def _join(
    client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    connect: Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]],
) -> None:
    reader, writer = client
    try:
        upstream_reader, upstream_writer = await connect()
    except OSError:
        writer.close()
        return
    try:
        await asyncio.gather(_copy(reader, upstream_writer), _copy(upstream_reader, writer))
    finally:
        for end in (writer, upstream_writer):
            end.close()
            with contextlib.suppress(ConnectionError, OSError):
                await end.wait_closed()


def _connection_handler(
    connect: Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]],
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """A server's per-connection callback that keeps its own tasks alive.

    asyncio holds a connection's task only through the connection's own objects, and once either
    side has sent EOF neither socket is watched for reading: the garbage collector would destroy the
    pending task and drop the answer still on its way (`tests/unit/test_relay.py`). The set lives as
    long as the server (it holds this callback). A connection cancelled when its loop stops ends
    quietly: nothing awaits it, and asyncio 3.11's own done-callback raises on a cancelled task."""
    connections: set[asyncio.Task[Any]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None, "asyncio runs a server's callback in a task"
        connections.add(task)
        try:
            await _join((reader, writer), connect)
        except asyncio.CancelledError:
            pass
        finally:
            connections.discard(task)

    return handle


async def serve_unix_to_tcp(path: str, host: str, port: int) -> asyncio.Server:
    """Listens on Unix socket `path` (connectable by the sandbox's user) and relays to `host:port`."""
    handle = _connection_handler(lambda: asyncio.open_connection(host, port))
    server = await asyncio.start_unix_server(handle, path=path)
    os.chmod(path, 0o666)
    return server


async def serve_tcp_to_unix(port: int, path: str) -> asyncio.Server:
    """Listens on 127.0.0.1:`port` and relays each connection to Unix socket `path`."""
    handle = _connection_handler(lambda: asyncio.open_unix_connection(path))
    return await asyncio.start_server(handle, "127.0.0.1", port)
