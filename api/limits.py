"""Request body limits: 413 with the JSON error shape before a too-large body is read into memory.

Uploads (`POST /v1/files`) may be up to `max_upload_bytes`, every other body up to `max_body_bytes`.
A declared `Content-Length` over the limit is refused at once; a chunked body is counted as it
arrives and cut off when it passes the limit.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
