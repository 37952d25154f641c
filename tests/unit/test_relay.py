"""The sandbox's path to a gateway: a loopback port relayed to a Unix socket, relayed to TCP.

A relay's connection lives in a task that only the event loop's callbacks point at. Once one side
has closed its direction (an HTTP client that shuts down writing, or an unclosed client that the
sandbox's garbage collector closes), neither socket of that connection may be watched for reading,
and the cycle task <-> streams <-> transports was unreachable: the garbage collector destroyed the
pending task ("Task was destroyed but it is pending!", seen in a suite run whose validation then
lost two responses). These tests run the collector at that moment and check the answer still
arrives, and that nothing was destroyed.
"""

from __future__ import annotations

import asyncio
import gc
import socket
from pathlib import Path
from typing import Any

from opd_trainer.workers.relay import serve_tcp_to_unix, serve_unix_to_tcp


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _chain(tmp_path: Path, answer: asyncio.Event) -> tuple[int, list[asyncio.Server]]:
    """upstream TCP server <- Unix relay <- loopback relay; the upstream answers each request once
    `answer` is set, then closes its side."""

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await reader.readline()
            await answer.wait()
        except asyncio.CancelledError:  # the loop stopped first (the shutdown test); not the relay's side
            return
        writer.write(b"answer to " + request)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    upstream_port = server.sockets[0].getsockname()[1]
    socket_path = str(tmp_path / "gateway.sock")
    unix_relay = await serve_unix_to_tcp(socket_path, "127.0.0.1", upstream_port)
    port = _free_port()
    loopback_relay = await serve_tcp_to_unix(port, socket_path)
    return port, [server, unix_relay, loopback_relay]


def test_a_half_closed_connection_survives_the_garbage_collector(tmp_path: Path) -> None:
    async def main() -> tuple[bytes, list[dict[str, Any]]]:
        problems: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: problems.append(context))
        answer = asyncio.Event()
        port, servers = await _chain(tmp_path, answer)
        clients = []
        for number in range(4):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"request {number}\n".encode())
            await writer.drain()
            writer.write_eof()  # done sending: only the relays' tasks now wait for the answer
            clients.append((reader, writer))
        await asyncio.sleep(0.2)  # the EOF has crossed both relays
        gc.collect()
        answer.set()
        replies = [await asyncio.wait_for(reader.read(), 10) for reader, _ in clients]
        for _, writer in clients:
            writer.close()
        for server in servers:
            server.close()
        await asyncio.sleep(0.1)
        return b"|".join(replies), problems

    replies, problems = asyncio.run(main())
    assert replies == b"|".join(b"answer to request %d\n" % number for number in range(4))
    assert not problems, problems


def test_connections_left_open_at_shutdown_end_quietly(tmp_path: Path) -> None:
    """A loop that stops with relay connections open (a worker shutting down) cancels them without an
    'Unhandled exception in client_connected_cb' from asyncio's own callback."""
    problems: list[dict[str, Any]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: problems.append(context))
        port, _servers = await _chain(tmp_path, asyncio.Event())
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"never answered\n")
        await writer.drain()
        await asyncio.sleep(0.2)

    asyncio.run(main())
    assert not problems, problems
