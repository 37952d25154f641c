"""Beacon pool: runs the job's user `AbstractBeaconProcessor` component (seed 003's hindsight beacons)
on finished, scored rollouts: given a rollout and its trained turns, it returns feedback for the turns
that went wrong (`driver/beacons.py` has each rewritten with it)."""

from __future__ import annotations

from pydantic import JsonValue

from opd_trainer.sdk import AgentOutput, BeaconInput, BeaconOutput, BeaconTurn, RequestMetadata
from opd_trainer.workers.pool import WorkerPool


class BeaconPool(WorkerPool):
    component_types = ("beacon",)

    async def beacons(
        self,
        *,
        sample_id: str,
        rollout_id: str,
        ground_truth: JsonValue,
        agent_output: AgentOutput,
        reward: float,
        component_rewards: dict[str, float],
        turns: list[BeaconTurn],
    ) -> BeaconOutput:
        """The component's output for one rollout (FAILED, with the reason, when its call failed)."""

        def payload(attempt_id: int) -> BeaconInput:
            return BeaconInput(
                ground_truth=ground_truth,
                agent_output=agent_output,
                reward=reward,
                component_rewards=component_rewards,
                turns=turns,
                request_metadata=RequestMetadata(
                    job_id=self.job_id, sample_id=sample_id, rollout_id=rollout_id, attempt_id=attempt_id
                ),
            )

        result = await self.run(payload, rollout_id)
        output: BeaconOutput = result["output"]
        return output
