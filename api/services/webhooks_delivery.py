"""The webhook deliverer: an asyncio task of the server that POSTs the outbox's due deliveries.

Every `webhook_poll_interval_s` (and whenever an attempt ends) it takes the due deliveries
(`webhooks.due`: a job's later event waits for its earlier ones to the same endpoint), claims each
(`webhooks.claim`: several server processes never send one at once) and sends it, at most
`webhook_concurrency` at a time. Its own task on the server's event loop, with database work in
threads: a slow or failing receiver holds neither requests nor the scheduler (a thread of its own).

One attempt: the URL is checked again (`webhooks_urls.vet_async`: where its name resolves now), then
the JSON is POSTed to the checked address (`Host` and TLS SNI keep the name), signed as Standard
Webhooks says (`opd_trainer.client.webhooks.sign`), within `webhook_timeout_s` all told, redirects
not followed. A 2xx delivers it. A network error, a timeout, a 5xx or a 429 is tried again after
`backoff` (a 429's `Retry-After` if longer), up to `webhook_max_attempts`; anything else (3xx, other
4xx, a URL now refused) fails it at once. Every attempt is logged (`webhooks.record`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from typing import Any

import anyio
import httpx

from api.db import Database, database_unavailable
from api.services import webhooks
from api.settings import Settings
from api.webhooks_urls import AllowedHosts, Unresolvable, UrlRefused, parse_allowed_hosts, vet_async
from opd_trainer.client.webhooks import sign

logger = logging.getLogger(__name__)

USER_AGENT = "opd-trainer-webhooks/1"
PRUNE_EVERY_S = 3600.0


def backoff(failures: int, base_s: float, cap_s: float, rng: random.Random | None = None) -> float:
    """Seconds before the next attempt after `failures` failed ones (1-based): `base_s`, doubling,
    at most `cap_s`, then jittered to between half and all of that (retries from many deliveries that
    failed together spread out)."""
    ceiling = min(cap_s, base_s * 2 ** max(failures - 1, 0))
    return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)


def retryable(status_code: int) -> bool:
    return status_code == 429 or status_code >= 500


def retry_after_s(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After", "")
    return float(value) if value.replace(".", "", 1).isdigit() else None


class Deliverer:
    """Owns the delivery task; `start()` in the app's lifespan, `await stop()` when it ends."""

    def __init__(
        self, settings: Settings, db: Database, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.settings = settings
        self.db = db
        self.allowed: AllowedHosts = parse_allowed_hosts(settings.webhook_allowed_hosts)
        self._transport = transport
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._busy: set[int] = set()
        self._attempts: set[asyncio.Task[None]] = set()
        self._http: httpx.AsyncClient | None = None
        self._last_prune = 0.0

    def start(self) -> None:
        self._http = httpx.AsyncClient(
            transport=self._transport,
            follow_redirects=False,
            trust_env=False,  # no proxy from the environment: the checked address is where it goes
            timeout=httpx.Timeout(self.settings.webhook_timeout_s),
            limits=httpx.Limits(max_connections=self.settings.webhook_concurrency),
        )
        self._task = asyncio.create_task(self._main(), name="opd-webhooks")

    async def stop(self) -> None:
        """Ends the loop and any attempt in flight (an attempt cut short is not recorded: its claim
        expires and it is sent again, at least once)."""
        tasks = [t for t in (self._task, *self._attempts) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._http is not None:
            await self._http.aclose()

    async def _main(self) -> None:
        while True:
            try:
                await self._round()
            except Exception as exc:
                if database_unavailable(exc):  # the scheduler says so once; the next round tries again
                    logger.debug("webhook delivery round: database unavailable (%s)", type(exc).__name__)
                else:
                    logger.exception("webhook delivery round failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.webhook_poll_interval_s)
            self._wake.clear()

    async def _round(self) -> None:
        now = time.time()
        if now - self._last_prune > PRUNE_EVERY_S:
            self._last_prune = now
            before = now - self.settings.webhook_log_retention_days * 86400
            await anyio.to_thread.run_sync(self._in_session, webhooks.prune, before)
        free = self.settings.webhook_concurrency - len(self._attempts)
        if free <= 0:
            return
        due = await anyio.to_thread.run_sync(self._in_session, webhooks.due, now, free, set(self._busy))
        hold = self.settings.webhook_timeout_s
        for seq in due:
            delivery = await anyio.to_thread.run_sync(
                self._in_session, webhooks.claim, seq, time.time(), hold
            )
            if delivery is None:
                continue
            self._busy.add(seq)
            task = asyncio.create_task(self._attempt(delivery), name=f"opd-webhook-{seq}")
            self._attempts.add(task)
            task.add_done_callback(self._attempt_done)

    def _attempt_done(self, task: asyncio.Task[None]) -> None:
        self._attempts.discard(task)
        self._wake.set()

    def _in_session(self, function: Any, *args: Any) -> Any:
        with self.db.session() as session:
            return function(session, *args)

    async def _attempt(self, delivery: dict[str, Any]) -> None:
        seq, number = delivery["seq"], delivery["number"]
        try:
            status_code, error, outcome, wait_s, duration_ms = await self._send(delivery)
            next_at = time.time() + wait_s if outcome == "pending" else None
            if outcome == "pending" and number >= self.settings.webhook_max_attempts:
                outcome, next_at = "failed", None
            await anyio.to_thread.run_sync(
                self._in_session,
                webhooks.record,
                seq,
                number,
                delivery["started_at"],
                status_code,
                error,
                duration_ms,
                outcome,
                next_at,
            )
            if outcome == "failed":
                logger.warning("webhook %s failed after %d attempts: %s", seq, number, error or status_code)
        except Exception:
            logger.exception("webhook delivery %s: recording the attempt failed", seq)
        finally:
            self._busy.discard(seq)

    async def _send(self, delivery: dict[str, Any]) -> tuple[int | None, str | None, str, float, float]:
        """One POST: (status code, error, outcome delivered|pending|failed, wait before the next, ms)."""
        assert self._http is not None
        settings = self.settings
        wait_s = backoff(delivery["number"], settings.webhook_backoff_base_s, settings.webhook_backoff_cap_s)
        delivery["started_at"] = time.time()
        started = time.monotonic()

        def elapsed_ms() -> float:
            return (time.monotonic() - started) * 1000

        try:
            async with asyncio.timeout(settings.webhook_timeout_s):
                target = await vet_async(delivery["url"], self.allowed, settings.webhook_timeout_s)
                body = json.dumps(delivery["payload"], separators=(",", ":")).encode()
                timestamp = int(time.time())
                headers = {
                    "Host": target.url.host_header,
                    "Content-Type": "application/json",
                    "User-Agent": USER_AGENT,
                    "webhook-id": delivery["event_id"],
                    "webhook-timestamp": str(timestamp),
                    "webhook-signature": sign(delivery["secret"], delivery["event_id"], timestamp, body),
                }
                extensions = {"sni_hostname": target.url.host} if target.url.scheme == "https" else {}
                request = self._http.build_request(
                    "POST", target.pinned_url, content=body, headers=headers, extensions=extensions
                )
                response = await self._http.send(request, stream=True)
                await response.aclose()  # the answer's body is not read
        except Unresolvable as exc:
            return None, exc.message, "pending", wait_s, elapsed_ms()
        except UrlRefused as exc:
            return None, f"url refused: {exc.message}", "failed", 0.0, elapsed_ms()
        except TimeoutError:
            return None, f"timed out after {settings.webhook_timeout_s:g}s", "pending", wait_s, elapsed_ms()
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"[:500], "pending", wait_s, elapsed_ms()
        status = response.status_code
        if 200 <= status < 300:
            return status, None, "delivered", 0.0, elapsed_ms()
        if retryable(status):
            after = retry_after_s(response) if status == 429 else None
            if after is not None:
                wait_s = max(wait_s, min(after, settings.webhook_backoff_cap_s))
            return status, f"HTTP {status}", "pending", wait_s, elapsed_ms()
        why = "redirects are not followed" if 300 <= status < 400 else "not retried"
        return status, f"HTTP {status} ({why})", "failed", 0.0, elapsed_ms()
