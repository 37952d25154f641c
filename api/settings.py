"""The job server's settings: one `BaseSettings`, read from `OPD_*` environment variables, checked at start.

Every default lives here. `DATABASE_URL` is honoured as well as `OPD_DATABASE_URL`, because that is the
name managed PostgreSQL offerings and Helm charts set.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from api.webhooks_urls import parse_allowed_hosts
from opd_trainer.driver.trackers import parse_allowed_uris

MIB = 1024 * 1024
GIB = 1024 * MIB


class Settings(BaseSettings):
    """Server settings; construct with keyword arguments in tests, from the environment otherwise."""

    model_config = SettingsConfigDict(env_prefix="OPD_", extra="ignore", populate_by_name=True)

    data_dir: Path = Field(
        default=Path("opd-data"),
        description="Uploaded files, extracted workspaces, run directories and the default SQLite file.",
    )
    database_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("OPD_DATABASE_URL", "DATABASE_URL", "database_url"),
        description="SQLAlchemy URL; None means sqlite:///<data_dir>/opd.db. postgresql+psycopg://... works.",
    )
    admin_key: SecretStr | None = Field(
        default=None, description="Bearer key allowed to create tenant keys; None disables key creation."
    )
    max_concurrent_jobs: int = Field(
        default=1, ge=0, description="Jobs running at once; 0 keeps every job queued and never starts Ray."
    )
    max_concurrent_jobs_per_tenant: int | None = Field(
        default=None,
        ge=1,
        description="Jobs of one tenant running at once; None means max_concurrent_jobs. Below it, one "
        "tenant's jobs (stuck or many) leave slots to the others; queued jobs start fairly across tenants.",
    )
    shared_teacher_idle_s: float | None = Field(
        default=None,
        ge=0,
        description="Share teacher engines between jobs: jobs whose teacher is the same model (same folder, "
        "context, dtype and resources.teacher) score on one engine group the service owns, admitted fairly "
        "per job and metered per job; it is shut down after this many seconds without a job holding it. "
        "None (default): every job starts its own teacher engines.",
    )
    shared_teacher_max_replicas: int | None = Field(
        default=None,
        ge=1,
        description="With shared teacher engines: the most replicas a shared group grows to while jobs' "
        "requests wait for a slot (one added at a time, given back when idle). None: a group keeps the "
        "first job's resources.teacher.replicas.",
    )
    shared_student_idle_s: float | None = Field(
        default=None,
        ge=0,
        description="Share student engines between LoRA jobs (hyper_parameters.lora): jobs whose student is "
        "the same base model (same folder, context, dtype, resources.student, and a LoRA rank vLLM serves "
        "alike) sample on one engine group the service owns, each with its own adapter, admitted fairly "
        "per job and metered per job; a job's adapter is unloaded when it ends, and the group is shut down "
        "after this many seconds without a job holding it. Full-training jobs always start their own. "
        "None (default): every job starts its own student engines.",
    )
    shared_student_max_jobs: int = Field(
        default=4,
        ge=1,
        description="With shared student engines: the most LoRA jobs one group serves at once (its vLLM "
        "max_loras is this plus one); a job past it starts another group.",
    )
    tenant_max_active_jobs: int = Field(
        default=8, ge=1, description="Non-terminal jobs (queued, running, paused, ...) one tenant may hold."
    )
    max_body_bytes: int = Field(default=1 * MIB, ge=1024, description="Largest JSON request body.")
    max_upload_bytes: int = Field(default=256 * MIB, ge=1024, description="Largest file upload (multipart).")
    workspace_max_files: int = Field(default=2000, ge=1, description="Most entries in a workspace zip.")
    workspace_max_uncompressed_bytes: int = Field(
        default=512 * MIB, ge=1024, description="Largest total extracted size of a workspace zip."
    )
    workspace_max_compression_ratio: float = Field(
        default=200.0, gt=1, description="Largest uncompressed/compressed ratio of one zip entry (zip bombs)."
    )
    model_max_files: int = Field(default=10_000, ge=1, description="Most entries in an uploaded model zip.")
    model_max_uncompressed_bytes: int = Field(
        default=64 * 1024 * MIB, ge=1024, description="Largest total extracted size of an uploaded model zip."
    )
    tenant_max_files: int = Field(
        default=1000, ge=1, description="Files (datasets, workspaces, models) one tenant may hold at once."
    )
    tenant_max_file_bytes: int = Field(
        default=100 * GIB,
        ge=1024,
        description="Bytes one tenant's files may take on the server: each upload plus what its zip "
        "extracts to. An upload past it is refused before it is stored.",
    )
    dataset_max_line_bytes: int = Field(
        default=1 * MIB, ge=1024, description="Longest line (one record) of an uploaded JSONL dataset."
    )
    dataset_max_records: int = Field(
        default=1_000_000, ge=1, description="Most records (non-blank lines) in one uploaded dataset."
    )
    dataset_validate_timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="Wall-clock bound on validating one uploaded dataset (done in a child process).",
    )
    dataset_validate_max_memory_bytes: int = Field(
        default=4 * GIB,
        ge=256 * MIB,
        description="Address-space limit of the child process that validates one uploaded dataset.",
    )
    model_max_tokenizer_bytes: int = Field(
        default=64 * MIB,
        ge=1024,
        description="Largest total size of the files pre-flight reads from a model folder inside the API "
        "process (config.json and the tokenizer's files).",
    )
    rate_limit_per_s: float = Field(
        default=50.0,
        ge=0,
        description="Requests per second one API key may make on average (a token bucket per key, in "
        "each server process); 0 turns rate limiting off. /healthz, /readyz and /metrics are exempt.",
    )
    rate_limit_burst: int = Field(
        default=200, ge=1, description="Requests one API key may make at once before the rate applies."
    )
    event_stream_max_s: float = Field(
        default=3600.0,
        ge=1,
        le=86400,
        description="Longest one event stream (SSE) stays open; it then ends with a `reconnect` event.",
    )
    event_streams_per_tenant: int = Field(
        default=16, ge=1, description="Event streams one tenant may hold open at once (per server process)."
    )
    model_dirs: list[Path] = Field(
        default_factory=list,
        description="Operator-approved model folders (JSON list): a job's model and teacher_model must lie "
        "under one of them or in one of the tenant's own jobs' checkpoints. Empty means <data_dir>/models.",
    )
    tracker_allowed_uris: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Tracking servers a job's mlflow_tracking_uri may name, comma-separated "
        "scheme://host[:port] (e.g. http://mlflow.internal:5000), matched on scheme, host and port. Empty: "
        "none; jobs report to MLFLOW_TRACKING_URI or a store in their run folder. sqlite:/file: never. Job "
        "drivers read the same variable: set it where they run (the embedded Ray inherits it).",
    )
    ray_address: str | None = Field(
        default=None, description="Ray cluster to join; None starts an embedded local Ray (or $RAY_ADDRESS)."
    )
    poll_interval_s: float = Field(
        default=1.0, gt=0, le=60, description="How often the scheduler polls running job drivers."
    )
    scheduler_lease_s: float = Field(
        default=30.0,
        ge=2,
        le=3600,
        description="Seconds the scheduler lease lasts without renewal: with several API replicas on one "
        "database, one schedules and another takes over this long after it stops renewing (at once after "
        "a graceful stop, or when the holder ran on the same host and its process is gone).",
    )
    cancel_grace_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="Seconds a cancelled job's driver has to stop by itself (after its current step, with "
        "a checkpoint); past it the scheduler kills the driver and every actor it started, and the job is "
        "cancelled.",
    )
    driver_unresponsive_s: float = Field(
        default=120.0,
        gt=0,
        le=3600,
        description="Seconds a job's driver may go without answering the scheduler's poll (its start "
        "included) before it counts as lost: killed and restarted from its checkpoint, at most "
        "max_driver_restarts times.",
    )
    max_driver_restarts: int = Field(
        default=2, ge=0, description="Times a job's driver that died is restarted from its checkpoint."
    )
    max_recoveries: int = Field(
        default=3,
        ge=0,
        description="A job's resources.max_recoveries when it gives none: times its driver recovers from a "
        "lost engine, gateway host, learner rank or node (restart, resume from the latest checkpoint).",
    )
    webhook_allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Webhook receivers allowed besides the public internet, comma-separated: host, "
        "host:port, IP address or CIDR (e.g. hooks.internal:8443,10.20.0.0/16,127.0.0.1:9000). By default "
        "a webhook URL must be https and its host resolve only to public addresses; a URL whose host "
        "(and port, when the entry names one) matches an entry, or whose addresses all lie in the "
        "entries' networks, may also be http and private.",
    )
    webhook_max_attempts: int = Field(
        default=12, ge=1, le=100, description="Attempts at delivering one webhook event before it fails."
    )
    webhook_backoff_base_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="Wait before a webhook's second attempt; it doubles after each failure (with jitter: "
        "between half and all of it), up to webhook_backoff_cap_s.",
    )
    webhook_backoff_cap_s: float = Field(
        default=3600.0, gt=0, le=86400, description="Longest wait between two attempts of one webhook."
    )
    webhook_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=120,
        description="Bound on one webhook attempt: resolve, connect, send, answer.",
    )
    webhook_concurrency: int = Field(
        default=16, ge=1, le=1000, description="Webhook attempts in flight at once (per server process)."
    )
    webhook_poll_interval_s: float = Field(
        default=1.0, gt=0, le=60, description="How often the webhook deliverer looks for due deliveries."
    )
    webhook_max_endpoints_per_tenant: int = Field(
        default=10, ge=1, le=1000, description="Webhook endpoints one tenant may register."
    )
    webhook_log_retention_days: float = Field(
        default=30.0,
        gt=0,
        description="Days a finished webhook delivery (delivered or failed) and its attempts stay listed.",
    )

    @field_validator("database_url", "admin_key", "ray_address", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        # Charts and .env files often set a variable to "" to mean "not set".
        return None if value == "" else value

    @field_validator("data_dir")
    @classmethod
    def _absolute_data_dir(cls, value: Path) -> Path:
        # Run directories are handed to Ray actors in other processes: relative paths would break.
        return value.expanduser().resolve()

    @field_validator("tracker_allowed_uris", mode="before")
    @classmethod
    def _tracking_servers(cls, value: object) -> object:
        return parse_allowed_uris(value) if isinstance(value, str | list) else value

    @field_validator("webhook_allowed_hosts", mode="before")
    @classmethod
    def _webhook_hosts(cls, value: object) -> object:
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, list):
            entries = [str(entry).strip() for entry in value if str(entry).strip()]
            parse_allowed_hosts(entries)  # a bad entry fails the start, naming it
            return entries
        return value

    @field_validator("database_url")
    @classmethod
    def _known_database(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("sqlite:", "postgresql")):
            raise ValueError("must be a sqlite:// or postgresql:// SQLAlchemy URL")
        return value

    @field_validator("admin_key")
    @classmethod
    def _long_admin_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("must be at least 16 characters (it guards key creation)")
        return value

    @model_validator(mode="after")
    def _upload_fits_workspace(self) -> Settings:
        if self.max_body_bytes > self.max_upload_bytes:
            raise ValueError("max_body_bytes must not exceed max_upload_bytes")
        return self

    @model_validator(mode="after")
    def _upload_fits_quota(self) -> Settings:
        if self.tenant_max_file_bytes < self.max_upload_bytes:
            raise ValueError(
                "tenant_max_file_bytes must be at least max_upload_bytes (else a largest upload never fits)"
            )
        return self

    @model_validator(mode="after")
    def _answer_time_above_poll(self) -> Settings:
        if self.driver_unresponsive_s <= self.poll_interval_s:
            raise ValueError("driver_unresponsive_s must exceed poll_interval_s")
        return self

    @model_validator(mode="after")
    def _backoff_cap_above_base(self) -> Settings:
        if self.webhook_backoff_cap_s < self.webhook_backoff_base_s:
            raise ValueError("webhook_backoff_cap_s must be at least webhook_backoff_base_s")
        return self

    @field_validator("model_dirs")
    @classmethod
    def _absolute_model_dirs(cls, value: list[Path]) -> list[Path]:
        return [folder.expanduser().resolve() for folder in value]

    @property
    def approved_model_dirs(self) -> list[Path]:
        return self.model_dirs or [self.data_dir / "models"]

    @property
    def sqlalchemy_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'opd.db'}"

    @property
    def files_dir(self) -> Path:
        return self.data_dir / "files"

    @property
    def workspaces_dir(self) -> Path:
        return self.data_dir / "workspaces"

    @property
    def uploaded_models_dir(self) -> Path:
        return self.data_dir / "uploaded-models"

    @property
    def runs_dir(self) -> Path:
        return self.data_dir / "runs"

    @property
    def tenant_slots(self) -> int:
        """Jobs one tenant may have running at once."""
        return self.max_concurrent_jobs_per_tenant or self.max_concurrent_jobs

    @property
    def scheduler_enabled(self) -> bool:
        return self.max_concurrent_jobs > 0


# Environment variables that carry the server's secrets (the admin key, database credentials).
SECRET_ENV_VARS = ("OPD_ADMIN_KEY", "OPD_DATABASE_URL", "DATABASE_URL")


def withhold_secrets_from_children() -> list[str]:
    """Removes the server's secrets from this process's environment once `Settings` has read them.

    Everything the server starts afterwards inherits its environment: the embedded Ray, its job
    drivers and the workers that run user processors. Returns the names removed.
    """
    removed = [name for name in SECRET_ENV_VARS if name in os.environ]
    for name in removed:
        del os.environ[name]
    return removed
