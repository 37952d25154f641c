"""Rollout pool: runs the user's `AbstractRolloutProcessor` for each (prompt, rollout) of a step.

Each call receives a `RolloutInput` whose `model_resource` points at the job's recording gateway with
a per-rollout API key, so the student tokens the agent produced are recorded for training. A step's
rollouts are submitted together (`rollouts`): each worker gets its share in one Ray call and each
rollout's answer streams back as it ends, with the calls its key recorded (the worker closes the key,
`opd_trainer/recorded_calls.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import JsonValue

from opd_trainer.recorded_calls import GatewayKey
from opd_trainer.records import LLMCall
from opd_trainer.sdk import ModelResource, RequestMetadata, RolloutInput, RolloutOutput
from opd_trainer.workers.pool import ProcessorCall, WorkerPool


@dataclass(frozen=True)
class RolloutRequest:
    """One rollout for the processor: its sample, sampling and models (`RolloutInput`'s fields)."""

    sample_id: str
    rollout_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    ground_truth: JsonValue
    rollout_extra: dict[str, Any]
    sampling_params: dict[str, Any]
    model_resource: ModelResource
    auxiliary_models: dict[str, ModelResource] = field(default_factory=dict)


@dataclass
class RolloutAnswer:
    """What one rollout's call returned: the processor's output, its trace spans, the attempt that
    produced it, and the calls its student key recorded (None when its worker did not return them:
    the caller closes the key then)."""

    output: RolloutOutput
    spans: list[dict[str, Any]]
    attempt_id: int
    calls: list[LLMCall] | None


class RolloutPool(WorkerPool):
    component_types = ("rollout",)

    def rollouts(self, requests: list[RolloutRequest], close_secret: str) -> list[Awaitable[RolloutAnswer]]:
        """Submits `requests` together (`WorkerPool.submit`); one awaitable answer per request, in the
        order given. `close_secret`: the student gateway's, with which each worker closes its rollout's
        key (`model_resource`) when the rollout ends."""
        calls = [
            ProcessorCall(
                self._payload_of(request),
                request.rollout_id,
                GatewayKey(
                    request.model_resource.base_url,
                    request.model_resource.api_key.get_secret_value(),
                    close_secret,
                ),
            )
            for request in requests
        ]
        return [_answer(future) for future in self.submit(calls)]

    def _payload_of(self, request: RolloutRequest) -> Callable[[int], RolloutInput]:
        def payload(attempt_id: int) -> RolloutInput:
            return RolloutInput(
                messages=request.messages,
                tools=request.tools,
                ground_truth=request.ground_truth,
                rollout_extra=request.rollout_extra,
                sampling_params=request.sampling_params,
                model_resource=request.model_resource,
                auxiliary_models=request.auxiliary_models,
                request_metadata=RequestMetadata(
                    job_id=self.job_id,
                    sample_id=request.sample_id,
                    rollout_id=request.rollout_id,
                    attempt_id=attempt_id,
                ),
            )

        return payload


async def _answer(future: asyncio.Future[dict[str, Any]]) -> RolloutAnswer:
    result = await future
    return RolloutAnswer(result["output"], result["spans"], result["attempt_id"], result.get("calls"))
