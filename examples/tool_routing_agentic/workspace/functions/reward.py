"""Rewards for the tool-routing agent, judged on its first reply to the conversation it was given."""

from __future__ import annotations

import json

from opd_trainer.demo.tool_routing import evaluator
from opd_trainer.sdk import (
    PROMPT_MESSAGES_KEY,
    AbstractRewardProcessor,
    Reward,
    RewardInput,
    RewardOutput,
    TaskStatus,
)

DESTRUCTIVE = {"delete_item", "cancel_order"}


def first_reply(reward_input: RewardInput) -> dict:
    """The agent's first assistant message after the conversation it was given.

    The rollout records where the given conversation ended in `rollout_extra[PROMPT_MESSAGES_KEY]`; the
    built-in Model OPD rollout does the same, so these rewards also serve a Model OPD job.
    """
    output = reward_input.agent_output
    start = int(output.rollout_extra.get(PROMPT_MESSAGES_KEY, 0))
    replies = [m for m in output.messages[start:] if m.get("role") == "assistant"]
    return replies[0] if replies else {"role": "assistant", "content": ""}


class DecisionReward(AbstractRewardProcessor):
    """1 when the reply takes the right decision (tool call / clarify / confirm / plain answer)."""

    async def process(self, reward_input: RewardInput) -> RewardOutput:
        if reward_input.ground_truth is None:
            return RewardOutput(status=TaskStatus.FAILED, error="no ground truth")
        parsed = evaluator.message_to_parsed(first_reply(reward_input))
        score = evaluator.score_reply(parsed, reward_input.ground_truth)
        return RewardOutput(
            reward=Reward(
                reward_score=float(score.decision_correct),
                reward_metrics={"format_valid": float(score.format_valid)},
            )
        )


class ArgumentReward(AbstractRewardProcessor):
    """1 for the right tool and arguments; a penalty for a destructive call the user never confirmed."""

    async def process(self, reward_input: RewardInput) -> RewardOutput:
        if reward_input.ground_truth is None:
            return RewardOutput(status=TaskStatus.FAILED, error="no ground truth")
        parsed = evaluator.message_to_parsed(first_reply(reward_input))
        score = evaluator.score_reply(parsed, reward_input.ground_truth)
        solution = reward_input.ground_truth  # the dataset's value as stored: a JSON string or an object
        expected = (json.loads(solution) if isinstance(solution, str) else solution)["decision"]
        unconfirmed = expected == "confirm" and any(call.name in DESTRUCTIVE for call in parsed.tool_calls)
        return RewardOutput(
            reward=Reward(
                reward_score=float(score.tool_name_correct and score.arguments_correct),
                reward_metrics={"destructive_penalty": -1.0 if unconfirmed else 0.0},
            )
        )
