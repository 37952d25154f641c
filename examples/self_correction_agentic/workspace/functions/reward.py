"""Episode reward: 1 for exactly the expected calls in order and a final answer naming the item, 0.5 for
the right calls without that answer, else 0; `self_corrected` is logged for episodes that hit a moved
item's error (1 when the next turn was the corrected call)."""

from __future__ import annotations

from opd_trainer.demo.tool_routing.self_correction import score_episode
from opd_trainer.sdk import (
    PROMPT_MESSAGES_KEY,
    AbstractRewardProcessor,
    Reward,
    RewardInput,
    RewardOutput,
    TaskStatus,
)


class EpisodeReward(AbstractRewardProcessor):
    async def process(self, reward_input: RewardInput) -> RewardOutput:
        if reward_input.ground_truth is None:
            return RewardOutput(status=TaskStatus.FAILED, error="no ground truth")
        output = reward_input.agent_output
        start = int(output.rollout_extra.get(PROMPT_MESSAGES_KEY, 0))
        score = score_episode(output.messages, start, reward_input.ground_truth)
        metrics = {"calls_correct": float(score.calls_correct), "answered": float(score.answered)}
        if score.hit_moved_error:
            metrics["self_corrected"] = float(score.self_corrected)
        value = 1.0 if score.success else 0.5 if score.calls_correct else 0.0
        return RewardOutput(reward=Reward(reward_score=value, reward_metrics=metrics))
