"""Beacon pool: runs the job's user `AbstractBeaconProcessor` component (TurnSight's hindsight beacons)
on finished, rewarded rollouts: given a rollout and its trained turns, it returns feedback for the turns
that went wrong (`signal/beacons.py` has each rewritten with it); given one rewrite, its `verify` says
whether the rewrite works when replayed against the episode's tools (True, False, or None: not checked).
Both calls go through the same sandboxed workers (`workers/pool.py`), by method name."""

from __future__ import annotations

from typing import Any

from pydantic import JsonValue

from opd_trainer.sdk import (
    AgentOutput,
    BeaconInput,
    BeaconOutput,
    BeaconTurn,
    BeaconVerdict,
    BeaconVerifyInput,
    RequestMetadata,
    TaskStatus,
)
from opd_trainer.workers.pool import WorkerPool


class BeaconPool(WorkerPool):
    component_types = ("beacon",)

    def _metadata(self, sample_id: str, rollout_id: str, attempt_id: int) -> RequestMetadata:
        return RequestMetadata(
            job_id=self.job_id, sample_id=sample_id, rollout_id=rollout_id, attempt_id=attempt_id
        )

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
                request_metadata=self._metadata(sample_id, rollout_id, attempt_id),
            )

        result = await self.run(payload, rollout_id)
        output: BeaconOutput = result["output"]
        return output

    async def verify(
        self,
        *,
        sample_id: str,
        rollout_id: str,
        ground_truth: JsonValue,
        rollout_extra: dict[str, Any],
        tools: list[dict[str, Any]] | None,
        agent_output: AgentOutput,
        turn: BeaconTurn,
        feedback: str,
        rewrite: dict[str, Any],
    ) -> BeaconVerdict:
        """The component's verdict on one rewrite (FAILED, with the reason, when its call failed)."""

        def payload(attempt_id: int) -> BeaconVerifyInput:
            return BeaconVerifyInput(
                ground_truth=ground_truth,
                rollout_extra=rollout_extra,
                tools=tools,
                agent_output=agent_output,
                turn=turn,
                feedback=feedback,
                rewrite=rewrite,
                request_metadata=self._metadata(sample_id, rollout_id, attempt_id),
            )

        result = await self.run(payload, rollout_id)
        output = result["output"]
        if isinstance(output, BeaconVerdict):
            return output
        # The pool's own failures (a worker that kept dying, a timeout) come as the kind's output.
        return BeaconVerdict(status=TaskStatus.FAILED, error=getattr(output, "error", None) or "failed")
