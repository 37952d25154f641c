"""Rollout pool: runs the user's `AbstractRolloutProcessor` for each (prompt, rollout) of a step.

Each call receives a `RolloutInput` whose `model_resource` points at the job's recording gateway with
a per-rollout API key, so the student tokens the agent produced are recorded for training.
"""

from __future__ import annotations

from typing import Any

from pydantic import JsonValue

from opd_trainer.sdk import ModelResource, RequestMetadata, RolloutInput, RolloutOutput
from opd_trainer.workers.pool import WorkerPool


class RolloutPool(WorkerPool):
    component_types = ("rollout",)

    async def rollout(
        self,
        *,
        sample_id: str,
        rollout_id: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        ground_truth: JsonValue,
        rollout_extra: dict[str, Any],
        sampling_params: dict[str, Any],
        model_resource: ModelResource,
        auxiliary_models: dict[str, ModelResource] | None = None,
    ) -> tuple[RolloutOutput, list[dict[str, Any]], int]:
        """Returns the processor's output, its trace spans and the attempt that produced it."""

        def payload(attempt_id: int) -> RolloutInput:
            return RolloutInput(
                messages=messages,
                tools=tools,
                ground_truth=ground_truth,
                rollout_extra=rollout_extra,
                sampling_params=sampling_params,
                model_resource=model_resource,
                auxiliary_models=auxiliary_models or {},
                request_metadata=RequestMetadata(
                    job_id=self.job_id, sample_id=sample_id, rollout_id=rollout_id, attempt_id=attempt_id
                ),
            )

        result = await self.run(payload, rollout_id)
        return result["output"], result["spans"], result["attempt_id"]
