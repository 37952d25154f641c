"""Turns an OpenAI-style conversation into the exact prompt token ids a model is sampled on."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase


def prompt_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The model's chat template with the assistant generation prompt appended, tokenized.

    Rendered to text first and encoded without extra special tokens: the template already places
    every special token, and this is exactly what vLLM's chat endpoint does.
    """
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))
