"""What a job driver reports: its progress and its events (to whoever polls it over Ray: the job
server's scheduler, `opd train`), and its recoveries (`recoveries.jsonl`, read back by the next
incarnation).

An event is written to the run directory's `events.jsonl` as `DriverEvent.model_dump()` gives it
(`storage/run_dir.py`), and the server copies it into the job's event list (`EventPublic`), so its
keys are those files' and that API's.

What is read back may come from another build (a run dir written before an upgrade, a driver started
by an earlier server), so reading is lenient where one odd value would otherwise cost the rest: a
progress drops its metrics that are not numbers, an event of a kind this build does not emit passes
through, and `driver_events` skips a record that is no event at all.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

logger = logging.getLogger(__name__)

DriverStatus = Literal["created", "running", "stopped", "succeeded", "failed"]
"""`created` until `run()` starts; `stopped`: after a stop request (pause, cancel) or `stop_after`."""

DriverEventType = Literal[
    "status",  # the job's life: starting, training N steps, resumed, stopped, succeeded
    "preflight",  # the learner/sampler drift probe of a fresh start
    "step",  # one training step done
    "eval",  # one validation pass done (its metrics)
    "eval_failures",  # rollouts of a validation pass that failed
    "eval_outcomes",  # each validation sample's outcome in one student pass (`RunDir.validation_outcomes`)
    "checkpoint",  # a checkpoint saved, or old ones removed (keep_last_n)
    "promotion",  # a new promoted checkpoint
    "budget",  # a budget reached: the job stops
    "usage",  # what the job used, at its end
    "autoscale",  # a processor pool scaled up or down
    "preemption",  # a node holding a part of the job posted a preemption notice
    "recovery",  # a part of the job was lost: restarting and resuming
    "warning",  # something the user should know; the job goes on
    "error",  # what failed the job
]

ValidationSummary = dict[str, dict[str, float]]
"""What a job's run returns and summary.json holds: the validation metrics of `teacher`,
`student_before` and `student_after`, those the job ran."""


class DriverProgress(BaseModel):
    """A driver's answer to `progress()`: where the job is now."""

    model_config = ConfigDict(frozen=True)

    status: DriverStatus = Field(description="The driver's status (not the server's job status).")
    step: int = Field(ge=0, description="Training steps done.")
    total_steps: int = Field(ge=0, description="Training steps planned; 0 until the datasets are read.")
    metrics: dict[str, float] = Field(
        default_factory=dict, description="The latest step's metrics, with the pools' live numbers."
    )
    eta_s: float | None = Field(default=None, description="Seconds to the last step, while running.")
    usage: dict[str, float] = Field(
        default_factory=dict, description="What the job used so far over all its runs (`driver/metering.py`)."
    )

    @field_validator("metrics", "usage", mode="before")
    @classmethod
    def _numbers_only(cls, values: object) -> object:
        """Keeps the entries that are numbers and drops the rest (a metric some step or pool reports as
        text or None), so one odd metric never costs the whole answer; None reads as empty."""
        if values is None:
            return {}
        if not isinstance(values, dict):
            return values  # not a mapping at all: fails validation, naming the field
        return {key: value for key, value in values.items() if isinstance(value, int | float)}


class DriverEvent(BaseModel):
    """One line of `events.jsonl`: something the driver did or saw."""

    model_config = ConfigDict(frozen=True)

    seq: int = Field(ge=0, description="Its place in the driver's events: 0, 1, 2, ... per incarnation.")
    time: float = Field(description="When it happened, Unix seconds.")
    # A run dir or a driver of another build may hold kinds this one does not emit: passed through.
    type: DriverEventType | str = Field(description="What kind of event it is (`DriverEventType`).")
    message: str = Field(description="One line for people.")
    # Each kind carries its own fields (a step's metrics, a checkpoint's path, an error's `field`),
    # passed through as given: the API's `EventPublic.data` and the console read them by name.
    data: dict[str, Any] = Field(default_factory=dict, description="The event's fields.")


class RecoveryRecord(BaseModel):
    """One line of `recoveries.jsonl`: a recovery from a lost component (`driver/recovery.py`)."""

    time: float = Field(description="When it was decided, Unix seconds.")
    step: int = Field(description="Training steps done when the component was lost.")
    cause: str = Field(description="What failed, as the repeat rule compares it (`recovery.cause_of`).")
    message: str = Field(description="What was lost, for people.")
    resumes_from: int | None = Field(description="The checkpoint's step it resumes from; None: the start.")


def driver_events(records: Iterable[object], source: str) -> list[DriverEvent]:
    """The records that are events, as `DriverEvent`s: a driver's own, or their dicts as events.jsonl
    holds them (and as a driver of an earlier build returns them). Any other record is skipped, with
    one warning naming `source`, so one odd line never stops whoever reads them."""
    events: list[DriverEvent] = []
    skipped: list[ValidationError] = []
    for record in records:
        try:
            events.append(DriverEvent.model_validate(record))
        except ValidationError as error:
            skipped.append(error)
    if skipped:
        logger.warning(
            "%s: skipped %d record(s) that are not driver events; the first: %s",
            source,
            len(skipped),
            skipped[0],
        )
    return events
