"""Request and response models of the HTTP API: `XCreate` in, `XPublic` out, per resource.

The job body is the engine's own `JobSpec` (one definition of every field), with dataset and
workspace fields holding uploaded file ids.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from opd_trainer.spec.job_spec import JobSpec
from opd_trainer.spec.job_status import JobStatus

FilePurpose = Literal["dataset", "workspace"]


class _Public(BaseModel):
    model_config = ConfigDict(from_attributes=True)


# -- keys -----------------------------------------------------------------------------------------


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str = Field(
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Tenant name; created on first use.",
    )


class KeyPublic(_Public):
    object: Literal["api_key"] = "api_key"
    id: str
    tenant: str
    prefix: str = Field(description="First characters of the key, to tell keys apart.")
    created_at: int
    key: str | None = Field(default=None, description="The secret key; returned once, at creation.")


class KeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[KeyPublic]


# -- files ----------------------------------------------------------------------------------------


class FilePublic(_Public):
    object: Literal["file"] = "file"
    id: str
    filename: str
    purpose: FilePurpose
    bytes: int
    created_at: int
    samples: int | None = Field(default=None, description="Datasets: number of validated records.")


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FilePublic]


class Deleted(BaseModel):
    id: str
    object: str
    deleted: bool = True


# -- jobs -----------------------------------------------------------------------------------------


class JobCreate(JobSpec):
    """A job spec; `training_datasets`/`validation_datasets` and `fcmodel.workspace` are file ids."""


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class JobPublic(_Public):
    object: Literal["opd.job"] = "opd.job"
    id: str
    job_name: str
    status: JobStatus
    created_at: int
    started_at: int | None = None
    finished_at: int | None = None
    step: int = 0
    total_steps: int | None = None
    eta_s: float | None = None
    metrics: dict[str, float] = Field(default_factory=dict, description="The latest step's metrics.")
    trained_tokens: float = Field(default=0.0, description="Completion tokens trained on so far.")
    fine_tuned_model: str | None = Field(
        default=None,
        description="Id of the checkpoint holding the trained student once the job succeeded (its last); "
        "`GET .../checkpoints/{id}/content` downloads it.",
    )
    error: JobError | None = None
    spec: dict[str, Any] = Field(description="The submitted job spec (with file ids).")


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobPublic]
    has_more: bool


class EventPublic(_Public):
    object: Literal["opd.job.event"] = "opd.job.event"
    id: int
    time: float
    type: str
    message: str
    data: dict[str, Any] = Field(default_factory=dict)


class EventList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EventPublic]
    has_more: bool


class CheckpointPublic(BaseModel):
    object: Literal["opd.job.checkpoint"] = "opd.job.checkpoint"
    id: str = Field(
        description="Checkpoint id within its job; `GET .../checkpoints/{id}/content` downloads it."
    )
    step: int = Field(description="Training steps done when it was saved.")
    created_at: int = Field(description="When it was committed (Unix seconds).")
    path: str = Field(description="Checkpoint folder on the server's data volume.")
    student: str = Field(
        description="The student as a Hugging Face model folder on the server; "
        "a new job's `model` may name it."
    )
    metrics: dict[str, float | None] = Field(
        default_factory=dict, description="The training metrics of its step (metrics.jsonl)."
    )
    eval: dict[str, float | None] | None = Field(
        default=None, description="The validation metrics at its step, when the job validated there."
    )


class CheckpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[CheckpointPublic]


class MetricsPublic(BaseModel):
    object: Literal["opd.job.metrics"] = "opd.job.metrics"
    data: list[dict[str, Any]] = Field(description="metrics.jsonl records: kind train|eval, step, values.")
    summary: dict[str, Any] = Field(
        default_factory=dict, description="Validation of teacher, student before and after."
    )


class TrajectoryList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]] = Field(description="Recent rollouts: messages, tool calls, rewards, spans.")


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    checks: dict[str, str] = Field(default_factory=dict)
