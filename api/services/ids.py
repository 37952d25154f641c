"""Object ids: a type prefix and random hex, so ids are unguessable and say what they name."""

from __future__ import annotations

import secrets


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"
