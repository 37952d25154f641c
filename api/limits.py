"""Request limits, answered before a route runs: body size (413) and each key's request rate (429).

Uploads (`POST /v1/files`) may be up to `max_upload_bytes`, every other body up to `max_body_bytes`.
A declared `Content-Length` over the limit is refused at once; a chunked body is counted as it
arrives and cut off when it passes the limit. Each API key gets a token bucket (`rate_limit_per_s`,
`rate_limit_burst`); a request past it is answered 429 with `Retry-After`, which the project's clients
wait out and retry. `StreamSlots` bounds the event streams a tenant holds open.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import APIError

UPLOAD_PATHS = frozenset({"/v1/files"})


class _TooLarge(Exception):
    pass


def _error_body(limit: int) -> bytes:
    error = {"code": "request_too_large", "message": f"request body exceeds {limit} bytes", "param": None}
    return json.dumps({"error": error}).encode()


async def _send_413(send: Send, limit: int) -> None:
    body = _error_body(limit)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, max_upload_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_upload_bytes = max_upload_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_upload_bytes if scope["path"].rstrip("/") in UPLOAD_PATHS else self.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > limit
            except ValueError:
                too_big = False  # the server rejects a malformed length itself
            if too_big:
                await _send_413(send, limit)
                return
        state = {"received": 0, "too_large": False, "started": False}

        async def counting_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > limit:
                    state["too_large"] = True
                    raise _TooLarge
            return message

        async def guarded_send(message: Message) -> None:
            # Whatever the app answers after the cut-off (a parse error, a 500), the answer is 413.
            if state["too_large"]:
                return
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _TooLarge:
            pass
        except Exception:
            if not state["too_large"]:
                raise
        if state["too_large"] and not state["started"]:
            await _send_413(send, limit)


# Answered without a key and without counting: probes and scrapes must never be throttled.
RATE_EXEMPT_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
# Buckets kept at most (least recently used dropped): keys that are not real still cost memory.
MAX_BUCKETS = 100_000


class TokenBuckets:
    """One token bucket per caller: `burst` requests at once, refilled at `per_s` a second.

    In memory, per process: with several API replicas each grants the rate, so the rate a key gets
    overall is the setting times the replicas its requests reach.
    """

    def __init__(self, per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_s = per_s
        self.burst = burst
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, caller: str) -> float:
        """Takes one token of `caller`'s bucket: 0.0 if it had one, else the seconds until it will."""
        now = self.clock()
        tokens, then = self._buckets.pop(caller, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.per_s)
        wait = 0.0
        if tokens >= 1:
            tokens -= 1
        else:
            wait = (1 - tokens) / self.per_s
        self._buckets[caller] = (tokens, now)
        if len(self._buckets) > MAX_BUCKETS:
            self._buckets.popitem(last=False)
        return wait


def _caller(scope: Scope) -> str:
    """The bearer key's digest, or the client address for requests without one."""
    authorization = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, key = authorization.partition(b" ")
    if scheme.lower() == b"bearer" and key.strip():
        return "key:" + hashlib.sha256(key.strip()).hexdigest()
    client = scope.get("client")
    return f"addr:{client[0] if client else '?'}"


class RateLimitMiddleware:
    """429 with `Retry-After` once a key has used its bucket (`TokenBuckets`); health and metrics are
    exempt. Runs on the event loop, so the buckets need no lock."""

    def __init__(self, app: ASGIApp, per_s: float, burst: int) -> None:
        self.app = app
        self.buckets = TokenBuckets(per_s, burst)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].rstrip("/") in RATE_EXEMPT_PATHS:
            await self.app(scope, receive, send)
            return
        wait = self.buckets.take(_caller(scope))
        if not wait:
            await self.app(scope, receive, send)
            return
        retry_after = max(1, math.ceil(wait))
        error = {
            "code": "rate_limit_exceeded",
            "message": f"more than {self.buckets.per_s:g} requests/s (burst {self.buckets.burst}) with this "
            f"API key (OPD_RATE_LIMIT_PER_S, OPD_RATE_LIMIT_BURST); retry after {retry_after} s",
            "param": None,
        }
        body = json.dumps({"error": error}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(retry_after).encode()),
        ]
        await send({"type": "http.response.start", "status": 429, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class StreamSlots:
    """Event streams open at once per tenant, at most `per_tenant` each (in this process): a stream
    holds a connection and polls the database twice a second for as long as it lasts."""

    def __init__(self, per_tenant: int) -> None:
        self.per_tenant = per_tenant
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()  # taken in the route's thread and on the event loop

    def acquire(self, tenant_id: str) -> Callable[[], None]:
        """Takes a slot of `tenant_id` (429 `stream_limit_reached` if none is free); returns its
        release, which may be called any number of times."""
        with self._lock:
            held = self._open.get(tenant_id, 0)
            if held >= self.per_tenant:
                raise APIError(
                    429,
                    "stream_limit_reached",
                    f"tenant already has {held} event streams open; the limit is {self.per_tenant} "
                    "(OPD_EVENT_STREAMS_PER_TENANT): close one, or page with GET .../events?after=",
                )
            self._open[tenant_id] = held + 1
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if released.is_set():
                    return
                released.set()
                left = self._open.get(tenant_id, 1) - 1
                if left > 0:
                    self._open[tenant_id] = left
                else:
                    self._open.pop(tenant_id, None)

        return release
