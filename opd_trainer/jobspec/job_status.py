"""The statuses of a job on the server, the one list the API, its database, metrics and the client share.

    validating_files → queued → running → succeeded | failed | cancelled
    running → pausing → paused → (resume) queued;   running | pausing → cancelling → cancelled
    queued | paused → cancelled (no driver to stop);  queued → paused

The transitions users may ask for are in `api.services.states`.
"""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Any


class JobStatus(StrEnum):
    VALIDATING_FILES = "validating_files"
    QUEUED = "queued"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL: tuple[JobStatus, ...] = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)
# Statuses in which a driver actor exists (or should) and holds a scheduler slot.
WITH_DRIVER: tuple[JobStatus, ...] = (JobStatus.RUNNING, JobStatus.PAUSING, JobStatus.CANCELLING)
ACTIVE: tuple[JobStatus, ...] = tuple(s for s in JobStatus if s not in TERMINAL)


def format_event_line(at: float, kind: str, message: str, data: dict[str, Any] | None = None) -> str:
    """One event as a log line: `TIME [type] message`, then an error's `data.detail` (e.g. the user's
    traceback) indented. The server's `/logs` and `opd logs` print the same lines."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at))
    line = f"{stamp}Z [{kind}] {message}"
    detail = (data or {}).get("detail")
    if isinstance(detail, str) and detail:
        line += "".join(f"\n    {part}" for part in detail.splitlines())
    return line
