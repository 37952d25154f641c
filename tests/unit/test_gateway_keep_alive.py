"""The built-in rollout's HTTP call survives a keep-alive connection the server closed, and retries only
requests that provably never reached the server (a real uvicorn server and aiohttp client, no Ray)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import uvicorn
from fastapi import FastAPI, Request

from opd_trainer.cluster.ports import free_port
from opd_trainer.rollout import runner
from opd_trainer.rollout.gateway import KEEP_ALIVE_S, Gateway
from opd_trainer.rollout.runner import CLIENT_KEEPALIVE_S, RolloutRunner, post_json


class CountingServer:
    """uvicorn in a thread of its own, serving one JSON echo route; `bodies` is what reached the app."""

    def __init__(self, keep_alive_s: float) -> None:
        self.bodies: list[Any] = []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def echo(request: Request) -> dict[str, Any]:
            body = await request.json()
            self.bodies.append(body)
            return {"echo": body}

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1/chat/completions"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", timeout_keep_alive=keep_alive_s
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> CountingServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def short_keep_alive() -> Iterator[CountingServer]:
    with CountingServer(keep_alive_s=0.3) as server:
        yield server


def runner_session() -> aiohttp.ClientSession:
    """The built-in rollout's own client pool, as the driver builds it."""
    return RolloutRunner("job", None, "unused", max_tokens=8, temperature=1.0)._session()  # type: ignore[arg-type]


async def fill_the_pool(http: aiohttp.ClientSession, url: str, n: int) -> None:
    """`n` requests in flight at once: `n` connections, idle in the pool when they return."""
    answers = await asyncio.gather(*(post_json(http, url, {"step": 1, "i": i}, {}) for i in range(n)))
    assert [status for status, _ in answers] == [200] * n


def busy_pause(seconds: float) -> None:
    """The driver's event loop busy (CPU work, or a process starved of cores): the server's FIN on each
    idle connection arrives meanwhile and is not read. `asyncio.sleep` would not reproduce the failure:
    an idle loop reads the FIN and the pool drops the connection."""
    time.sleep(seconds)


def test_a_keep_alive_connection_the_server_closed_during_a_pause_is_retried(
    short_keep_alive: CountingServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The efficacy run's failure (`ClientOSError: Can not write request body`) reproduced: the next
    step's requests, made right after a pause longer than the server's keep-alive, are written into
    the pooled connections the server closed. A plain POST fails so; the rollout's call retries the
    ones never sent, and each request reaches the server exactly once."""
    server = short_keep_alive
    n = 4

    async def run() -> tuple[list[Any], list[tuple[int, bytes]]]:
        async with runner_session() as http:
            await fill_the_pool(http, server.url, n)
            busy_pause(1.5)

            async def plain(i: int) -> Any:
                try:
                    async with http.post(server.url, json={"step": "plain", "i": i}) as response:
                        return response.status
                except aiohttp.ClientError as exc:
                    return exc

            failures = await asyncio.gather(*(plain(i) for i in range(n)))
            await fill_the_pool(http, server.url, n)  # the pool again: n fresh connections
            busy_pause(1.5)
            answers = await asyncio.gather(
                *(post_json(http, server.url, {"step": 2, "i": i}, {}) for i in range(n))
            )
            return failures, answers

    caplog.set_level(logging.INFO, logger=runner.__name__)
    failures, answers = asyncio.run(run())
    # Without the retry: the failure seen in the efficacy run (on each pooled connection, measured).
    errors = [f for f in failures if f != 200]
    assert errors and all(isinstance(f, aiohttp.ClientOSError) for f in errors), failures
    assert all("Can not write request body" in str(f) for f in errors), failures
    # With it: every call answered, after a retry, and none reached the server twice.
    assert [status for status, _ in answers] == [200] * n
    assert any("retried once" in record.getMessage() for record in caplog.records)
    step_2 = [body for body in server.bodies if body["step"] == 2]
    assert sorted(body["i"] for body in step_2) == list(range(n))
    assert not [body for body in server.bodies if body["step"] == "plain"]


def test_a_request_whose_body_was_written_is_never_retried() -> None:
    """A server that reads the whole request and closes without answering may have acted on it (the
    gateway would have recorded the call): the error reaches the caller, the request went out once."""
    received: list[bytes] = []

    async def read_then_drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        received.append(await reader.readexactly(length))
        writer.close()

    async def run() -> None:
        server = await asyncio.start_server(read_then_drop, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, runner_session() as http:
            with pytest.raises(aiohttp.ServerDisconnectedError):
                await post_json(http, f"http://127.0.0.1:{port}/v1/chat/completions", {"once": True}, {})

    asyncio.run(run())
    assert received == [b'{"once": true}']


def test_a_refused_connection_is_retried_once_then_raised() -> None:
    """Nothing is sent when the connection cannot be made: one retry, then the caller sees the error."""
    attempts: list[str] = []

    async def on_connect(*_: object) -> None:
        attempts.append("connect")

    async def run() -> None:
        trace = aiohttp.TraceConfig()
        trace.on_connection_create_start.append(on_connect)
        async with aiohttp.ClientSession(trace_configs=[trace]) as http:
            with pytest.raises(aiohttp.ClientConnectorError):
                await post_json(http, f"http://127.0.0.1:{free_port()}/v1/chat/completions", {}, {})

    asyncio.run(run())
    assert attempts == ["connect", "connect"]


def test_the_pool_drops_an_idle_connection_before_the_gateway_closes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cause removed: the rollout's pool, whose idle timeout is shorter than the server's keep-alive,
    never reuses a connection the server may have closed, even after a busy pause longer than both
    (aiohttp checks a connection's age against the clock when it hands it out, not when the loop runs):
    plain POSTs, no retry needed. Scaled down: client 0.3 s, server 0.8 s, pause 1.5 s; the trainer's
    are 15 s and 75 s."""
    assert CLIENT_KEEPALIVE_S < KEEP_ALIVE_S
    assert (
        Gateway("m", "unused", [], max_tokens=1, temperature=1.0, max_length=8).keep_alive_s == KEEP_ALIVE_S
    )
    monkeypatch.setattr(runner, "CLIENT_KEEPALIVE_S", 0.3)

    with CountingServer(keep_alive_s=0.8) as server:

        async def run() -> list[int]:
            async with runner_session() as http:
                await fill_the_pool(http, server.url, 4)
                busy_pause(1.5)

                async def plain(i: int) -> int:
                    async with http.post(server.url, json={"step": 2, "i": i}) as response:
                        return response.status

                return list(await asyncio.gather(*(plain(i) for i in range(4))))

        assert asyncio.run(run()) == [200] * 4
    assert len(server.bodies) == 8
