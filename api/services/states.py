"""The status transitions users may ask for (the statuses are `opd_trainer.jobspec.job_status`); anything
else is a 409.

Pre-flight runs inside the submit request, so a stored job normally starts at `queued`;
`validating_files` is the status of a job whose pre-flight is running.
"""

from __future__ import annotations

from api.errors import APIError
from opd_trainer.jobspec.job_status import ACTIVE, TERMINAL, WITH_DRIVER

__all__ = ["ACTIVE", "TERMINAL", "USER_TRANSITIONS", "WITH_DRIVER", "next_status"]

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
