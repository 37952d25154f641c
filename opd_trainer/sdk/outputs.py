"""What a processor returns (`RolloutOutput`, `RewardOutput` and their parts, `TaskStatus`) and what
makes a rollout a failure (`is_rollout_failure`). Needs only pydantic.

`types` re-exports all of it (user code imports `opd_trainer.sdk`); `tracing` reads processor outputs
from here, so it does not import `types`, which loads `tracing` on first use of a traced client.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "PROMPT_MESSAGES_KEY",
    "ROLLOUT_ERROR_PREFIX",
    "AgentOutput",
    "Reward",
    "RewardOutput",
    "RolloutOutput",
    "TaskStatus",
    "is_rollout_failure",
]

ROLLOUT_ERROR_PREFIX = "ROLLOUT_ERROR:"
"""Bailian's convention: an assistant message whose content starts with this marks a failed rollout."""

PROMPT_MESSAGES_KEY = "prompt_messages"
"""`AgentOutput.rollout_extra` key: how many of `messages` were the given conversation. The built-in Model
OPD rollout sets it, so a reward can judge the reply rather than the prompt's own assistant turns."""


class _Output(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TaskStatus(str, Enum):  # noqa: UP042 -- `str, Enum` like Bailian's, so `status == "FAILED"` holds
    """Outcome of one processor call."""

    SUCCESS = "SUCCESS"
    FAILED = "FAILED"


class AgentOutput(_Output):
    """The conversation a rollout produced; only its assistant turns are trained on."""

    messages: list[dict[str, Any]] = Field(description="Full conversation, prompt included (OpenAI format).")
    rollout_extra: dict[str, Any] = Field(default_factory=dict, description="Data handed on to rewards.")
    rollout_metrics: dict[str, float] = Field(default_factory=dict, description="Metrics to log, by name.")
    reward_score: float | None = Field(default=None, description="A reward the rollout computed itself.")


class RolloutOutput(_Output):
    """What a rollout processor returns."""

    agent_output: AgentOutput | None = Field(default=None, description="The conversation; None on failure.")
    status: TaskStatus = Field(default=TaskStatus.SUCCESS, description="SUCCESS or FAILED.")
    error: str | None = Field(default=None, description="Why it failed.")


class Reward(_Output):
    """A scalar score plus optional named sub-scores (logged, and weighted by `reward_metric_weight`)."""

    reward_score: float = Field(description="The score.")
    reward_metrics: dict[str, float] = Field(default_factory=dict, description="Named sub-scores.")


class RewardOutput(_Output):
    """What a reward processor returns."""

    reward: Reward | None = Field(default=None, description="The score; None on failure.")
    status: TaskStatus = Field(default=TaskStatus.SUCCESS, description="SUCCESS or FAILED.")
    error: str | None = Field(default=None, description="Why it failed.")


class Beacon(_Output):
    """Feedback on one turn of a finished rollout, written from what happened after it."""

    turn: int = Field(ge=0, description="The turn it is about: `BeaconTurn.turn` of the input.")
    feedback: str = Field(
        min_length=1,
        max_length=4000,
        description="What the turn should have known or done, from what followed it (e.g. 'the id it used "
        "does not exist; find_item returns the right one'). The rewriting model reads it under the "
        "beacon's header; it is never trained on.",
    )


class BeaconOutput(_Output):
    """What a beacon processor returns: feedback for any of the turns it was given (none: no beacon)."""

    beacons: list[Beacon] = Field(default_factory=list, description="At most one per turn.")
    status: TaskStatus = Field(default=TaskStatus.SUCCESS, description="SUCCESS or FAILED.")
    error: str | None = Field(default=None, description="Why it failed.")


def _text_parts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):  # OpenAI content parts: [{"type": "text", "text": ...}, ...]
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


def is_rollout_failure(output: RolloutOutput) -> bool:
    """True for a FAILED status, a missing `agent_output`, or an assistant turn starting `ROLLOUT_ERROR:`."""
    if output.status == TaskStatus.FAILED or output.agent_output is None:
        return True
    return any(
        text.lstrip().startswith(ROLLOUT_ERROR_PREFIX)
        for message in output.agent_output.messages
        if message.get("role") == "assistant"
        for text in _text_parts(message.get("content"))
    )
