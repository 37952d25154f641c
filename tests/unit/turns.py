"""One recorded turn (an LLM call's segment) of a rollout, built by hand: what the turn-level signals
(signal/hindsight.py, signal/pairs.py) read of a step's segments."""

from __future__ import annotations

from typing import Any

from opd_trainer.records import LLMCall


def turn(
    context: list[int],
    answer: list[int],
    rollout: int,
    reward: float,
    group: int = 0,
    reply: dict[str, Any] | None = None,
) -> LLMCall:
    """Prompt `context`, completion `answer`, in `rollout` of prompt `group`, whose reward is `reward`;
    its reply message `reply`, by default a plain text naming the answer's tokens (so that different
    answers are different actions, `actions.action_of`)."""
    text = " ".join(map(str, answer))
    return LLMCall(
        text=text,
        response_message=reply or {"role": "assistant", "content": text},
        prompt_token_ids=context,
        completion_token_ids=answer,
        sampler_logprobs=[-1.0] * len(answer),
        teacher_logprobs=[-1.0] * len(answer),
        group_id=group,
        rollout_id=rollout,
        reward=reward,
    )
