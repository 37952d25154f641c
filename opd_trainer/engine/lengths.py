"""How long a completion may be after a prompt: one rule for the engines and the gateway.

A sampled sequence (prompt + completion) stays one token under `max_model_len`: the teacher scores it by
teacher forcing, and vLLM's prompt logprobs need room for one generated token after the sequence, so a
student sequence of exactly `max_model_len` tokens could be generated but never scored (seen in a lookup
agent's run: a conversation grown to the job's `max_length` failed the step at the teacher).
"""

from __future__ import annotations


def completion_room(max_model_len: int, prompt_tokens: int) -> int:
    """Tokens a completion may have after `prompt_tokens` (< 1: the prompt does not fit)."""
    return max_model_len - 1 - prompt_tokens
