"""Job statuses and the transitions users may ask for; anything else is a 409.

    validating_files → queued → running → succeeded | failed | cancelled
    running → pausing → paused → (resume) queued;   running | pausing → cancelling → cancelled
    queued | paused → cancelled (no driver to stop);  queued → paused

Pre-flight runs inside the submit request, so a stored job normally starts at `queued`;
`validating_files` is the status of a job whose pre-flight is running.
"""

from __future__ import annotations

from api.errors import APIError

TERMINAL = ("succeeded", "failed", "cancelled")
# Statuses in which a driver actor exists (or should) and holds a scheduler slot.
WITH_DRIVER = ("running", "pausing", "cancelling")
ACTIVE = ("validating_files", "queued", "running", "pausing", "paused", "cancelling")

# action → {from status: to status}
USER_TRANSITIONS: dict[str, dict[str, str]] = {
    "cancel": {
        "validating_files": "cancelled",
        "queued": "cancelled",
        "paused": "cancelled",
        "running": "cancelling",
        "pausing": "cancelling",
    },
    "pause": {"queued": "paused", "running": "pausing"},
    "resume": {"paused": "queued"},
}


def next_status(action: str, current: str) -> str:
    """The status `action` moves a job in `current` to; 409 if it may not."""
    allowed = USER_TRANSITIONS[action]
    if current not in allowed:
        raise APIError(
            409,
            "invalid_transition",
            f"cannot {action} a job that is {current} (allowed from: {', '.join(allowed)})",
            "status",
        )
    return allowed[current]
