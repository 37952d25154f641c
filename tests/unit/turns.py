"""One recorded turn (an LLM call's segment) of a rollout, built by hand: what the turn-level signals
(learner/hindsight.py, learner/turn_preference.py) read of a step's segments."""

from __future__ import annotations

from opd_trainer.records import LLMCall


def turn(context: list[int], answer: list[int], rollout: int, reward: float, group: int = 0) -> LLMCall:
    """Prompt `context`, completion `answer`, in `rollout` of prompt `group`, whose reward is `reward`."""
    return LLMCall(
        prompt_token_ids=context,
        completion_token_ids=answer,
        sampler_logprobs=[-1.0] * len(answer),
        teacher_logprobs=[-1.0] * len(answer),
        group_id=group,
        rollout_id=rollout,
        reward=reward,
    )
