"""Reward pool: runs one user `AbstractRewardProcessor` component on finished rollouts.

Evaluator components use the same interface (they score validation rollouts only), so they run in a
reward pool too.
"""

from __future__ import annotations

from typing import Any

from pydantic import JsonValue

from opd_trainer.sdk import AgentOutput, ModelResource, RequestMetadata, RewardInput, RewardOutput
from opd_trainer.workers.pool import WorkerPool


class RewardPool(WorkerPool):
    component_types = ("reward", "evaluator")

    async def reward(
        self,
        *,
        sample_id: str,
        rollout_id: str,
        ground_truth: JsonValue,
        agent_output: AgentOutput,
        auxiliary_models: dict[str, ModelResource] | None = None,
    ) -> tuple[RewardOutput, list[dict[str, Any]]]:
        """The component's reward of one finished rollout (its output, FAILED with the reason when the
        call failed) and its trace spans."""

        def payload(attempt_id: int) -> RewardInput:
            return RewardInput(
                ground_truth=ground_truth,
                agent_output=agent_output,
                auxiliary_models=auxiliary_models or {},
                request_metadata=RequestMetadata(
                    job_id=self.job_id, sample_id=sample_id, rollout_id=rollout_id, attempt_id=attempt_id
                ),
            )

        result = await self.run(payload, rollout_id)
        return result["output"], result["spans"]
