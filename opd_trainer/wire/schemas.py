"""Request and response models of the HTTP API: `XCreate` in, `XPublic` out, per resource.

The job body is the engine's own `JobSpec` (one definition of every field), with dataset and
workspace fields holding uploaded file ids.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from opd_trainer.jobspec.job_spec import JobSpec
from opd_trainer.jobspec.job_status import JobStatus
from opd_trainer.wire.checkpoint import PromotionDecision

FilePurpose = Literal["dataset", "workspace", "model"]


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
    object: Literal["api_key"] = Field(default="api_key", description="Always `api_key`.")
    id: str = Field(description="Key id (not the secret); `DELETE /v1/keys/{id}` revokes it.")
    tenant: str = Field(description="Tenant the key acts for.")
    prefix: str = Field(description="First characters of the key, to tell keys apart.")
    created_at: int = Field(description="Creation time, Unix seconds.")
    key: str | None = Field(default=None, description="The secret key; returned once, at creation.")


class KeyList(BaseModel):
    object: Literal["list"] = Field(default="list", description="Always `list`.")
    data: list[KeyPublic] = Field(description="The keys, without their secrets.")


# -- files ----------------------------------------------------------------------------------------


class FilePublic(_Public):
    object: Literal["file"] = Field(default="file", description="Always `file`.")
    id: str = Field(description="File id; jobs name datasets and workspaces by it.")
    filename: str = Field(description="The uploaded name, reduced to safe characters.")
    purpose: FilePurpose = Field(
        description="`dataset` (JSONL, validated), `workspace` (zip, extracted) or `model` (a zipped "
        "Hugging Face model folder, extracted; a job's `model` / `teacher_model` may name it)."
    )
    bytes: int = Field(description="Size of the upload.")
    created_at: int = Field(description="Upload time, Unix seconds.")
    samples: int | None = Field(default=None, description="Datasets: number of validated records.")


class FileList(BaseModel):
    object: Literal["list"] = Field(default="list", description="Always `list`.")
    data: list[FilePublic] = Field(description="The tenant's files, newest first.")


class Deleted(BaseModel):
    id: str = Field(description="Id of what was deleted.")
    object: str = Field(description="Its kind: `file`, `opd.job`, `api_key` or `opd.webhook`.")
    deleted: bool = Field(default=True, description="Always true.")


# -- jobs -----------------------------------------------------------------------------------------


class JobCreate(JobSpec):
    """A job spec; `training_datasets`/`validation_datasets` and `fcmodel.workspace` are file ids."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "job_name": "support-agent-opd",
                    "model": "Qwen/Qwen2.5-0.5B-Instruct",
                    "teacher_model": "/data/models/qwen2.5-7b-instruct",
                    "training_datasets": ["file-3f9c2a1b7d4e4a0c9b1e"],
                    "validation_datasets": ["file-8a1d0c2e5b7f4c3a9d6e"],
                    "functions": [
                        {
                            "name": "judge",
                            "type": "reward",
                            "fcmodel": {
                                "workspace": "file-5c7e9a2d1b3f4e6a8c0d",
                                "classpath": "functions.reward.Judge",
                            },
                            "runtime": {"cpu": 1, "memory_size": 2048, "concurrency": 8},
                        }
                    ],
                    "hyper_parameters": {"max_steps": 200, "batch_size": 16, "n_rollouts": 4},
                }
            ]
        }
    )


class DryRun(BaseModel):
    """What a dry run (`POST /v1/opd/jobs?dry_run=true`) calibrates and, once it succeeded, estimates."""

    calibration_steps: int = Field(description="Steps the calibration runs (the job's first ones).")
    total_steps: int = Field(description="Steps of the whole job it stands for.")
    estimate: dict[str, Any] | None = Field(
        default=None,
        description="Once the calibration succeeded: `usage`, what the whole job would use per metered key "
        "(JobPublic.usage's keys: teacher_tokens, wall_s, cpu_s, ...), and the parts it was added up from "
        "(`start`, `first_step`, `step`, `validation`, `validations`), as `opd estimate` gives them.",
    )


class JobError(BaseModel):
    code: str = Field(description="Machine-readable reason, e.g. `job_failed`, `driver_lost`.")
    message: str = Field(description="What went wrong, for people.")
    param: str | None = Field(default=None, description="The job-spec field at fault, if one is.")


class JobPublic(_Public):
    object: Literal["opd.job"] = Field(default="opd.job", description="Always `opd.job`.")
    id: str = Field(description="Job id.")
    job_name: str = Field(description="The spec's `job_name`.")
    status: JobStatus = Field(description="validating_files, queued, running, pausing, paused, ...")
    created_at: int = Field(description="Submission time, Unix seconds.")
    started_at: int | None = Field(default=None, description="When a driver first started it.")
    finished_at: int | None = Field(default=None, description="When it succeeded, failed or was cancelled.")
    step: int = Field(default=0, description="Training steps done.")
    total_steps: int | None = Field(default=None, description="Training steps planned.")
    eta_s: float | None = Field(default=None, description="Seconds to the last step, from the pace so far.")
    metrics: dict[str, float] = Field(default_factory=dict, description="The latest step's metrics.")
    trained_tokens: float = Field(default=0.0, description="Completion tokens trained on so far.")
    usage: dict[str, float] = Field(
        default_factory=dict,
        description="What the job used so far over all its runs: teacher_tokens (teacher_cached_tokens of "
        "them from the prefix cache), student_prompt_tokens, student_generated_tokens, "
        "learner_tokens_forwarded, learner_tokens_trained, processor_calls, processor_seconds, wall_s, "
        "cpu_s, gpu_s and cpu_s/ROLE, gpu_s/ROLE per role (docs/guide.md, Usage and budgets).",
    )
    fine_tuned_model: str | None = Field(
        default=None,
        description="Id of the checkpoint holding the trained student once the job succeeded: the promoted "
        "one (best validation by `promotion.metric`, through its gates; null when no validation met them) "
        "for a job with validation data, else the last; `GET .../checkpoints/{id}/content` downloads it.",
    )
    best_checkpoint: str | None = Field(
        default=None, description="The promoted checkpoint so far (also while the job runs)."
    )
    promotion: PromotionDecision | None = Field(
        default=None,
        description="The promotion decision so far: metric, its direction, the starting student's value, "
        "the best step and value, whether it is final, and why (e.g. the gate no validation met).",
    )
    error: JobError | None = Field(default=None, description="Why it failed, once it has.")
    dry_run: DryRun | None = Field(
        default=None,
        description="Set for a dry run: it trains only a short calibration, for an estimate of the whole "
        "job (never a fine_tuned_model); null for a job.",
    )
    spec: dict[str, Any] = Field(description="The submitted job spec (with file ids).")


class TenantUsage(BaseModel):
    object: Literal["opd.usage"] = Field(default="opd.usage", description="Always `opd.usage`.")
    tenant_id: str = Field(description="The tenant's id.")
    tenant: str = Field(description="The tenant's name.")
    jobs: int = Field(description="Jobs of the tenant on record (deleted ones not counted).")
    usage: dict[str, float] = Field(
        description="The usage of all its jobs added up (JobPublic.usage keys), deleted jobs included."
    )


class UsageList(BaseModel):
    object: Literal["list"] = Field(default="list", description="Always `list`.")
    data: list[TenantUsage] = Field(
        description="One entry per tenant: the caller's, or every one for the admin."
    )


class JobList(BaseModel):
    object: Literal["list"] = Field(default="list", description="Always `list`.")
    data: list[JobPublic] = Field(description="Jobs, newest first.")
    has_more: bool = Field(description="More jobs follow: pass the last id as `after`.")


class EventPublic(_Public):
    object: Literal["opd.job.event"] = Field(default="opd.job.event", description="Always `opd.job.event`.")
    id: int = Field(description="Increasing event id; the `after` cursor and the stream's `Last-Event-ID`.")
    time: float = Field(description="When it happened, Unix seconds.")
    type: str = Field(description="status, step, eval, checkpoint, preflight, warning, error, autoscale, ...")
    message: str = Field(description="One line for people.")
    data: dict[str, Any] = Field(
        default_factory=dict, description="The event's fields, e.g. a step's metrics."
    )


class EventList(BaseModel):
    object: Literal["list"] = Field(default="list", description="Always `list`.")
    data: list[EventPublic] = Field(description="Events after the cursor, oldest first.")
    has_more: bool = Field(description="More events follow: pass the last id as `after`.")


class CheckpointPublic(BaseModel):
    object: Literal["opd.job.checkpoint"] = Field(
        default="opd.job.checkpoint", description="Always `opd.job.checkpoint`."
    )
    id: str = Field(
        description="Checkpoint id within its job; `GET .../checkpoints/{id}/content` downloads it."
    )
    step: int = Field(description="Training steps done when it was saved.")
    created_at: int = Field(description="When it was committed (Unix seconds).")
    path: str = Field(description="The checkpoint's folder, named `<job id>/checkpoints/<id>`.")
    student: str = Field(
        description="The student as a Hugging Face model folder, named `<job id>/checkpoints/<id>/student`; "
        "a new job of the same tenant may give this name as its `model` or `teacher_model`."
    )
    metrics: dict[str, float | None] = Field(
        default_factory=dict, description="The training metrics of its step (metrics.jsonl)."
    )
    eval: dict[str, float | None] | None = Field(
        default=None, description="The validation metrics at its step, when the job validated there."
    )
    promoted: bool = Field(default=False, description="It is the job's promoted (best) checkpoint.")


class CheckpointList(BaseModel):
    object: Literal["list"] = Field(default="list", description="Always `list`.")
    data: list[CheckpointPublic] = Field(description="Committed checkpoints, oldest first.")


class MetricsPublic(BaseModel):
    object: Literal["opd.job.metrics"] = Field(
        default="opd.job.metrics", description="Always `opd.job.metrics`."
    )
    data: list[dict[str, Any]] = Field(description="metrics.jsonl records: kind train|eval, step, values.")
    summary: dict[str, Any] = Field(
        default_factory=dict, description="Validation of teacher, student before and after."
    )


TrajectorySort = Literal["recent", "reward", "divergence"]
# A validation rollout is also sorted by its evaluator's score.
ValidationTrajectorySort = Literal["recent", "score", "reward", "divergence"]


class TrajectoryList(BaseModel):
    object: Literal["list"] = Field(default="list", description="Always `list`.")
    data: list[dict[str, Any]] = Field(
        description="Rollouts: `step`, messages, tool calls, rewards, spans, `divergence` (mean sampler − "
        "teacher logprob over its trained tokens, null without any) and per LLM call `tokens` (text, "
        "log_ratio, teacher_top, teacher_top_p per trained token; null for a call not trained)."
    )
    has_more: bool = Field(default=False, description="More follow: pass `offset` + `limit` as `offset`.")
    steps: list[int] = Field(default_factory=list, description="Every step that has trajectories, ascending.")


class ValidationPass(BaseModel):
    step: int = Field(description="The step the validation ran after (0: before training).")
    label: str = Field(description="`teacher`, `student before`, `step N` or `student after`.")
    model: Literal["student", "teacher"] = Field(
        description="Whose rollouts: the student's or the teacher's."
    )


class ValidationTrajectoryList(BaseModel):
    object: Literal["list"] = Field(default="list", description="Always `list`.")
    data: list[dict[str, Any]] = Field(
        description="Validation rollouts (the first 16 of each pass, by sample order): `step`, `label`, "
        "`model`, `sample_id`, messages, LLM calls, rewards, `eval_score` (null where the evaluator did "
        "not score it), `eval_metrics`, `eval_error`. A student's rollout has per LLM call `tokens` (text, "
        "log_ratio: the student's logprob of each token it wrote − the teacher's, teacher_top and "
        "teacher_top_p where the job asks for the teacher's top-k) and `divergence`, their mean; nothing of "
        "it is trained. The teacher's own have `tokens` and `divergence` null."
    )
    has_more: bool = Field(default=False, description="More follow: pass `offset` + `limit` as `offset`.")
    passes: list[ValidationPass] = Field(
        default_factory=list, description="Every recorded validation pass, in the order run."
    )
    steps: list[int] = Field(default_factory=list, description="Every step with a recorded pass, ascending.")
    labels: list[str] = Field(
        default_factory=list, description="Every recorded pass's label, in the order run."
    )


# -- webhooks -------------------------------------------------------------------------------------

WebhookEventType = Literal["job.running", "job.paused", "job.succeeded", "job.failed", "job.cancelled"]
WEBHOOK_EVENT_TYPES: tuple[WebhookEventType, ...] = (
    "job.running",
    "job.paused",
    "job.succeeded",
    "job.failed",
    "job.cancelled",
)


class WebhookCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        min_length=1,
        max_length=2048,
        description="Where events are POSTed: an https URL on the public internet (http and internal "
        "addresses only for receivers the operator allows, OPD_WEBHOOK_ALLOWED_HOSTS).",
    )
    events: list[WebhookEventType] | None = Field(
        default=None,
        min_length=1,
        max_length=len(WEBHOOK_EVENT_TYPES),
        description="The job status changes to send; default all: " + ", ".join(WEBHOOK_EVENT_TYPES) + ".",
    )
    description: str = Field(default="", max_length=256, description="A note for people.")


class WebhookPublic(_Public):
    object: Literal["opd.webhook"] = Field(default="opd.webhook", description="Always `opd.webhook`.")
    id: str = Field(description="Endpoint id.")
    url: str = Field(description="Where events are POSTed.")
    events: list[WebhookEventType] = Field(description="The event types it receives.")
    description: str = Field(default="", description="A note for people.")
    created_at: int = Field(description="Creation time, Unix seconds.")
    secret: str | None = Field(
        default=None,
        description="The signing secret (`whsec_...`); returned once, at creation. Deliveries are signed "
        "with it (Standard Webhooks: `webhook-id`, `webhook-timestamp`, `webhook-signature`).",
    )


class WebhookList(BaseModel):
    object: Literal["list"] = Field(default="list", description="Always `list`.")
    data: list[WebhookPublic] = Field(description="The tenant's endpoints, oldest first, without secrets.")


class WebhookJob(BaseModel):
    """The job as a webhook event carries it."""

    object: Literal["opd.job"] = Field(default="opd.job", description="Always `opd.job`.")
    id: str = Field(description="Job id.")
    job_name: str = Field(description="The spec's `job_name`.")
    status: JobStatus = Field(description="The status it moved to.")
    created_at: int = Field(description="Submission time, Unix seconds.")
    started_at: int | None = Field(default=None, description="When a driver first started it.")
    finished_at: int | None = Field(default=None, description="When it succeeded, failed or was cancelled.")
    fine_tuned_model: str | None = Field(
        default=None, description="The checkpoint holding the trained student, once it succeeded."
    )
    error: JobError | None = Field(default=None, description="Why it failed, when it has.")


class WebhookEvent(BaseModel):
    """The JSON body of one webhook delivery."""

    object: Literal["event"] = Field(default="event", description="Always `event`.")
    id: str = Field(description="Event id; also the `webhook-id` header, the same on every retry.")
    type: WebhookEventType = Field(description="What happened, e.g. `job.succeeded`.")
    created_at: float = Field(description="When the job's status changed, Unix seconds.")
    data: WebhookJob = Field(description="The job as it was then.")


class WebhookAttemptPublic(_Public):
    number: int = Field(description="1 for the first attempt, then 2, 3, ...")
    at: float = Field(description="When it was sent, Unix seconds.")
    status_code: int | None = Field(
        default=None, description="The receiver's HTTP status; None if none came."
    )
    error: str | None = Field(
        default=None, description="What went wrong: a network error, a refused URL, ..."
    )
    duration_ms: float = Field(description="From sending to the answer (or the error), milliseconds.")


class WebhookDeliveryPublic(_Public):
    object: Literal["opd.webhook.delivery"] = Field(
        default="opd.webhook.delivery", description="Always `opd.webhook.delivery`."
    )
    id: str = Field(description="Delivery id (one event to one endpoint).")
    event_id: str = Field(description="The event's id, its `webhook-id` header.")
    event_type: WebhookEventType = Field(description="e.g. `job.succeeded`.")
    job_id: str = Field(description="The job the event is about.")
    status: Literal["pending", "delivered", "failed"] = Field(
        description="`pending` (waiting for its next attempt), `delivered` (a 2xx answer) or `failed` "
        "(out of attempts, or an answer that is not retried: a 3xx or a 4xx other than 429)."
    )
    created_at: float = Field(description="When the event was written, Unix seconds.")
    next_attempt_at: float | None = Field(default=None, description="When it is tried next, while pending.")
    finished_at: float | None = Field(default=None, description="When it was delivered or failed.")
    payload: dict[str, Any] = Field(description="The JSON body (a `WebhookEvent`).")
    attempts: list[WebhookAttemptPublic] = Field(description="Every attempt so far, first first.")


class WebhookDeliveryList(BaseModel):
    object: Literal["list"] = Field(default="list", description="Always `list`.")
    data: list[WebhookDeliveryPublic] = Field(description="Deliveries, newest first.")
    has_more: bool = Field(description="More deliveries follow: pass the last id as `after`.")


class Health(BaseModel):
    status: Literal["ok", "unavailable"] = Field(description="`ok`, or `unavailable` (then HTTP 503).")
    checks: dict[str, str] = Field(
        default_factory=dict, description="Readiness: `database`, `ray`, `scheduler` and what each said."
    )
