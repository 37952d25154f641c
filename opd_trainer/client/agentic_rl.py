"""Bailian's submission classes (`AgenticRL`, `TrainingDataset`, ...): its scripts port by import lines.

Before (Bailian) and after (here), nothing else in the script changes:

    from dashscope.finetune.agentic_rl import AgenticRL
    from dashscope.finetune.reinforcement import (DataSourceType, FunctionComponentModel, ...)

    from opd_trainer.client.agentic_rl import AgenticRL
    from opd_trainer.client.agentic_rl import (DataSourceType, FunctionComponentModel, ...)

    result = await AgenticRL().run(job_name=..., model=..., teacher_model=..., training_datasets=[...],
                                   validation_datasets=[...], functions=[...], hyper_parameters={...},
                                   resources={...})
    if result.status_code != 200: raise RuntimeError(result.message)
    job_id = result.output.job_id

The server and key come from `AgenticRL(base_url=..., api_key=...)` or `OPD_BASE_URL` / `OPD_API_KEY`.
`run` validates the job locally, uploads each local dataset file (a `file_name` that is a file id is
used as is), zips and uploads each `fcmodel.zipdir`, and submits; relative paths resolve against the
current directory, as in Bailian's scripts. It answers like Bailian's: `status_code` 200 with
`output.job_id`, or the server's HTTP status (400 for a problem found before anything was sent) with
`code`, `message` and `param`; it never raises for a refused job, only for a server it cannot reach.

`run` is `AsyncOPDClient.run` (`opd_trainer.client`): the same validation, uploads (concurrent) and
submission as `OPDClient.run` and `opd submit`, awaited; folders are zipped in a worker thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

from opd_trainer.client.async_client import AsyncOPDClient
from opd_trainer.client.operations import OPDAPIError
from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.job_spec import (
    DatasetSource,
    DataSourceType,
    FcModel,
    FunctionComponent,
    FunctionRuntime,
)

__all__ = [
    "AgenticRL",
    "DataSourceType",
    "FunctionComponentModel",
    "FunctionComponentRuntime",
    "RewardFunctionComponent",
    "RolloutFunctionComponent",
    "SubmissionOutput",
    "SubmissionResult",
    "TrainingDataset",
    "ValidationDataset",
]


class TrainingDataset(DatasetSource):
    """A training JSONL file: `file_name` is a local path (uploaded by `run`) or a file id."""


class ValidationDataset(DatasetSource):
    """A validation JSONL file: `file_name` is a local path (uploaded by `run`) or a file id."""


class FunctionComponentModel(FcModel):
    """Where a processor's code lives (`zipdir`, zipped and uploaded by `run`) and its `classpath`."""


class FunctionComponentRuntime(FunctionRuntime):
    """Worker pool size and autoscaling of one component (cpu, memory_size, concurrency, capacity, ...)."""


class RolloutFunctionComponent(FunctionComponent):
    """The job's rollout processor (at most one)."""

    type: Literal["rollout"] = Field(default="rollout", description="Always `rollout`.")


class RewardFunctionComponent(FunctionComponent):
    """A reward processor; `weight` scales its score in the task reward."""

    type: Literal["reward"] = Field(default="reward", description="Always `reward`.")


class SubmissionOutput(BaseModel):
    """`output` of a submission: the job's id, None when it was refused."""

    job_id: str | None = Field(default=None, description="The new job's id.")


class SubmissionResult(BaseModel):
    """What `AgenticRL.run` returns, shaped like Bailian's response."""

    status_code: int = Field(description="200 when the job was submitted, else the HTTP status.")
    output: SubmissionOutput = Field(default_factory=SubmissionOutput, description="The job id.")
    code: str = Field(default="", description="Error code when refused (the server's `error.code`).")
    message: str = Field(default="", description="Why it was refused.")
    param: str | None = Field(default=None, description="The job field at fault, when one is.")


def _plain(value: Any) -> Any:
    """A submission object as the job document's JSON (the classes above are pydantic models)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_none=True)
    return value


class AgenticRL:
    """Submits Agentic (or Model) OPD jobs to one job server with one tenant key."""

    def __init__(
        self, base_url: str | None = None, api_key: str | None = None, timeout: float = 120.0
    ) -> None:
        # The client reads OPD_BASE_URL / OPD_API_KEY when these are None; a client per run keeps
        # `run` safe to call from several tasks at once.
        self.base_url = base_url
        self.api_key = api_key
        self.timeout = timeout

    async def run(
        self,
        job_name: str,
        model: str,
        teacher_model: str | list[dict[str, Any]],
        training_datasets: Sequence[TrainingDataset | dict[str, Any] | str],
        validation_datasets: Sequence[ValidationDataset | dict[str, Any] | str] | None = None,
        functions: Sequence[FunctionComponent | dict[str, Any]] | None = None,
        hyper_parameters: dict[str, Any] | None = None,
        resources: dict[str, Any] | None = None,
    ) -> SubmissionResult:
        """Uploads the job's local datasets and workspaces and submits it; see the module docstring."""
        try:
            async with AsyncOPDClient(self.base_url, self.api_key, self.timeout) as client:
                job_id = await client.run(
                    job_name=job_name,
                    model=model,
                    teacher_model=teacher_model,
                    training_datasets=[_plain(d) for d in training_datasets],
                    validation_datasets=[_plain(d) for d in validation_datasets or []],
                    functions=[_plain(f) for f in functions or []],
                    hyper_parameters=dict(hyper_parameters or {}),
                    resources=_plain(resources),
                )
        except OPDAPIError as exc:
            return SubmissionResult(
                status_code=exc.status, code=exc.code, message=exc.message, param=exc.field
            )
        except ConfigError as exc:  # found locally, before anything was sent (a missing file, a bad field)
            return SubmissionResult(
                status_code=400, code="invalid_config", message=exc.message, param=exc.field
            )
        return SubmissionResult(status_code=200, output=SubmissionOutput(job_id=job_id))
