"""The tool-routing task's evaluator component: exact match and its parts for a validation rollout.

A job lists it with `type: evaluator`; it implements the reward interface, runs on validation rollouts
only, and its `reward_metrics` are reported under their own names (`exact_match`, `decision_accuracy`,
...). It is this example task's evaluator, not the trainer's: a job on other data brings its own or
none, and validation still reports the reverse KL and the job's rewards.
"""

from __future__ import annotations

from typing import Any

from opd_trainer.demo.tool_routing import evaluator
from opd_trainer.sdk import (
    PROMPT_MESSAGES_KEY,
    AbstractRewardProcessor,
    AgentOutput,
    Reward,
    RewardInput,
    RewardOutput,
    TaskStatus,
)


def first_reply(output: AgentOutput) -> dict[str, Any]:
    """The first assistant message after the conversation the rollout was given (empty if none)."""
    start = int(output.rollout_extra.get(PROMPT_MESSAGES_KEY, 0))
    replies = [m for m in output.messages[start:] if m.get("role") == "assistant"]
    return replies[0] if replies else {"role": "assistant", "content": ""}


class ToolRoutingEvaluator(AbstractRewardProcessor):
    """Scores the first reply against `rollout_extra.solution` ({"decision", "tool_calls"})."""

    async def process(self, reward_input: RewardInput) -> RewardOutput:
        if reward_input.ground_truth is None:
            return RewardOutput(status=TaskStatus.FAILED, error="the sample has no rollout_extra.solution")
        # A solution of another shape raises here; the worker reports it as this sample's failure.
        score = evaluator.score_reply(
            evaluator.message_to_parsed(first_reply(reward_input.agent_output)), reward_input.ground_truth
        )
        metrics = {k: v for k, v in evaluator.aggregate([score]).items() if k != "n"}
        return RewardOutput(reward=Reward(reward_score=metrics["exact_match"], reward_metrics=metrics))
