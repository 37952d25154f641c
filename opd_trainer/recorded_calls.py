"""A rollout key's recorded calls as the gateway hands them over: closing keys over HTTP.

The recording gateway (`rollout/gateway.py`) records every call made with a rollout's key. Whoever ran
the rollout closes the key when it ends, and the answer carries what the key recorded: the rollout
worker, outside the sandbox, as soon as the user's `process` returns, so the calls travel back to the
driver with the rollout's result (`workers/pool.py`); the driver for its built-in rollout, for the
auxiliary models' keys and for a rollout whose worker did not return them (`rollout/runner.py`).

A chat completion sent with the close secret (the driver's built-in rollout: one call is the whole
rollout) closes its key once the call is recorded, and its answer carries the record beside the
completion (`encode_with_record`): the rollout costs one request.

Closing takes the gateway's close secret (header `X-OPD-Close-Secret`), which only trusted processes
hold: the driver, and the workers it hands a rollout's `GatewayKey` to (never the sandbox, whose
payload carries the rollout key alone). A rollout key is no credential here, so user code can neither
close a key nor read a record, its own or another rollout's, and the records the driver trains on
come from the gateway, never through user code.

The answer is JSON (not pickle: the peer is a network address): per key, its calls' recorded fields
(`RECORDED_FIELDS`; the others are filled later, by the driver), or null for a key the gateway does not
know. JSON floats are written with their shortest round-trip form, so token ids and logprobs arrive bit
for bit.

A gateway keeps the record of the keys it closed last (`gateway.CLOSED_KEYS_KEPT`): closing a key again
answers the same calls, so the driver's fallback close still gets them when the worker's close reached
the gateway but its answer did not reach the driver. A retried rollout's worker reopens the key first
(the reopen route), since the lost attempt's worker may have closed it: the record goes on from where
it ended, as if the key had stayed open.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from opd_trainer.records import LLMCall

CLOSE_ROUTE = "/rollouts/close"
"""The close route, under the gateway's `/v1` base URL; its body: `{"keys": [...]}`."""
REOPEN_ROUTE = "/rollouts/reopen"
"""The reopen route, beside the close route; its body: `{"keys": [...]}`; its answer: per key, whether it
is open now."""
CLOSE_SECRET_HEADER = "X-OPD-Close-Secret"
CLOSE_TIMEOUT_S = 60.0
RECORDED_FIELDS = (
    # sampled (the engine)
    "prompt_token_ids",
    "completion_token_ids",
    "sampler_logprobs",
    "weight_version",
    "finish_reason",
    "text",
    # served (the gateway)
    "messages",
    "tools",
    "template_kwargs",
    "response_message",
    "format_valid",
    "latency_s",
)
"""The fields of `LLMCall` a gateway fills; the rest keep their defaults until the driver sets them."""


@dataclass(frozen=True)
class GatewayKey:
    """A rollout key and what closes it: its gateway's base URL and close secret."""

    base_url: str
    key: str = field(repr=False)
    secret: str = field(repr=False)


def _fields(calls: list[LLMCall]) -> list[dict[str, Any]]:
    return [{name: getattr(call, name) for name in RECORDED_FIELDS} for call in calls]


def _calls(fields: list[dict[str, Any]]) -> list[LLMCall]:
    return [LLMCall(**{name: call[name] for name in RECORDED_FIELDS}) for call in fields]


def encode_recorded(recorded: list[list[LLMCall] | None]) -> bytes:
    """The close route's answer: for each key, its calls' `RECORDED_FIELDS` (null: an unknown key)."""
    return json.dumps([None if calls is None else _fields(calls) for calls in recorded]).encode()


def decode_recorded(answer: bytes) -> list[list[LLMCall] | None]:
    """What `encode_recorded` wrote, as calls."""
    return [None if fields is None else _calls(fields) for fields in json.loads(answer)]


def encode_with_record(completion_json: str, calls: list[LLMCall]) -> bytes:
    """A closing chat completion's answer: `{"completion": <the chat completion>, "recorded_calls":
    [...]}`; the completion as the gateway encoded it."""
    return f'{{"completion": {completion_json}, "recorded_calls": {json.dumps(_fields(calls))}}}'.encode()


def decode_with_record(answer: bytes) -> tuple[dict[str, Any], list[LLMCall]]:
    """What `encode_with_record` wrote: the chat completion, and the key's calls."""
    both = json.loads(answer)
    return both["completion"], _calls(both["recorded_calls"])


async def _post_keys(
    http: aiohttp.ClientSession, url: str, secret: str, keys: list[str], timeout_s: float
) -> bytes:
    """POSTs `{"keys": keys}` with the close secret; the answer's bytes. Raises `ConnectionError` when
    the gateway refuses, `TimeoutError` after `timeout_s`."""
    async with http.post(
        url,
        json={"keys": keys},
        headers={CLOSE_SECRET_HEADER: secret},
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    ) as response:
        answer = await response.read()
        if response.status != 200:
            raise ConnectionError(f"{url}: the gateway answered {response.status}")
    return answer


async def close_keys(
    http: aiohttp.ClientSession,
    base_url: str,
    secret: str,
    keys: list[str],
    timeout_s: float = CLOSE_TIMEOUT_S,
) -> list[list[LLMCall] | None]:
    """Closes `keys` on the gateway at `base_url` in one request; each key's calls, in the order asked (a
    key closed lately: the same calls again; None for a key the gateway does not know: never opened,
    expired, or closed before the records it keeps)."""
    answer = await _post_keys(http, f"{base_url}{CLOSE_ROUTE}", secret, keys, timeout_s)
    return decode_recorded(answer)


async def close_key(
    http: aiohttp.ClientSession, key: GatewayKey, timeout_s: float = CLOSE_TIMEOUT_S
) -> list[LLMCall] | None:
    """`close_keys` for one key."""
    [calls] = await close_keys(http, key.base_url, key.secret, [key.key], timeout_s)
    return calls


async def reopen_key(http: aiohttp.ClientSession, key: GatewayKey, timeout_s: float) -> bool:
    """Reopens a key closed lately, its record as it was (an open key stays as it is); whether it is
    open now."""
    answer = await _post_keys(http, f"{key.base_url}{REOPEN_ROUTE}", key.secret, [key.key], timeout_s)
    [reopened] = json.loads(answer)
    return bool(reopened)
