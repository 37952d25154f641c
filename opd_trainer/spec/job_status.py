"""The statuses of a job on the server, the one list the API, its database, metrics and the client share.

    validating_files → queued → running → succeeded | failed | cancelled
    running → pausing → paused → (resume) queued;   running | pausing → cancelling → cancelled
    queued | paused → cancelled (no driver to stop);  queued → paused

The transitions users may ask for are in `api.services.states`.
"""

from __future__ import annotations

from enum import StrEnum


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
