"""What a job driver reports: its progress and its events (to whoever polls it over Ray: the job
server's scheduler, `opd train`), and its recoveries (`recoveries.jsonl`, read back by the next
incarnation).

An event is written to the run directory's `events.jsonl` as `DriverEvent.model_dump()` gives it
(`storage/run_dir.py`), and the server copies it into the job's event list (`EventPublic`), so its
keys are those files' and that API's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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


class DriverEvent(BaseModel):
    """One line of `events.jsonl`: something the driver did or saw."""

    model_config = ConfigDict(frozen=True)

    seq: int = Field(ge=0, description="Its place in the driver's events: 0, 1, 2, ... per incarnation.")
    time: float = Field(description="When it happened, Unix seconds.")
    type: DriverEventType = Field(description="What kind of event it is.")
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
