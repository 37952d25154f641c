"""Webhook signatures as the Standard Webhooks spec defines them (https://www.standardwebhooks.com),
for the server that signs and the receiver that verifies.

Each delivery carries `webhook-id` (the event's id, the same on every retry: deduplicate by it),
`webhook-timestamp` (Unix seconds of this attempt) and `webhook-signature`: `v1,<base64 of
HMAC-SHA256(key, "<id>.<timestamp>.<body>")>`, where the key is the base64 after `whsec_` in the
endpoint's secret. A receiver:

    from opd_trainer.client.webhooks import verify_webhook
    event = verify_webhook(secret, request.headers, raw_body)  # raises WebhookVerificationError

Standard library only (`hmac`, `hashlib`, `base64`): a receiver needs nothing else, and the
`standardwebhooks` package verifies the same signatures.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Mapping
from typing import Any

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 24
DEFAULT_TOLERANCE_S = 300


class WebhookVerificationError(Exception):
    """The delivery is not from a holder of the secret, or is too old or too new to accept."""


def new_secret() -> str:
    """A fresh endpoint secret: `whsec_` and 24 random bytes in base64."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def _key(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX))


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header of `body` sent as `msg_id` at `timestamp`."""
    content = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(_key(secret), content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def verify_webhook(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now: float | None = None,
) -> dict[str, Any]:
    """The delivered event (the parsed body) once its signature is verified; `WebhookVerificationError`
    when a header is missing, the timestamp is more than `tolerance_s` from `now` (replays), or no
    signature matches. `headers`: any mapping; names are looked up in lower case first."""

    def header(name: str) -> str:
        value = headers.get(name) or headers.get(name.title())
        if not value:
            raise WebhookVerificationError(f"missing {name} header")
        return value

    msg_id, timestamp_text, signatures = (
        header("webhook-id"),
        header("webhook-timestamp"),
        header("webhook-signature"),
    )
    try:
        timestamp = int(timestamp_text)
    except ValueError:
        raise WebhookVerificationError("webhook-timestamp is not a number") from None
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        raise WebhookVerificationError("webhook-timestamp is too far from now")
    expected = sign(secret, msg_id, timestamp, body).encode()
    # Several space-separated signatures may be sent (a secret being rotated): one match is enough.
    if not any(hmac.compare_digest(expected, given.encode()) for given in signatures.split()):
        raise WebhookVerificationError("no matching signature")
    return json.loads(body)
