"""Episode reward (`lookup.EpisodeScore.reward`): 1 for a clean run (find_item on the named item, the
expected call on the id it returned, a final answer naming the id and the result), 0.75 for the same
after repairing errors, 0.25 for the right final state without that answer, else 0. The judge's parts
are logged: `calls_correct`, `answered`, `clean`, `errors`, and `repaired` for episodes that hit an
error (1 when they still succeeded)."""

from __future__ import annotations

from opd_trainer.demo.tool_routing.lookup import score_episode
from opd_trainer.sdk import (
    PROMPT_MESSAGES_KEY,
    AbstractRewardProcessor,
    Reward,
    RewardInput,
    RewardOutput,
    TaskStatus,
)


class LookupReward(AbstractRewardProcessor):
    async def process(self, reward_input: RewardInput) -> RewardOutput:
        if reward_input.ground_truth is None:
            return RewardOutput(status=TaskStatus.FAILED, error="no ground truth")
        output = reward_input.agent_output
        start = int(output.rollout_extra.get(PROMPT_MESSAGES_KEY, 0))
        score = score_episode(output.messages, start, reward_input.ground_truth)
        metrics = {
            "calls_correct": float(score.calls_correct),
            "answered": float(score.answered),
            "clean": float(score.clean),
            "errors": float(score.errors),
        }
        if score.errors:
            metrics["repaired"] = float(score.success)
        return RewardOutput(reward=Reward(reward_score=score.reward, reward_metrics=metrics))
