"""Turns an OpenAI-style conversation into the exact prompt token ids a model is sampled on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# apply_chat_template's own arguments: the trainer sets them; a job's or a client's
# template variables may not.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def prompt_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """The model's chat template with the assistant generation prompt appended, tokenized.

    Rendered to text first and encoded without extra special tokens: the template already places
    every special token, and this is exactly what vLLM's chat endpoint does. `template_kwargs` are
    extra template variables (`enable_thinking`, ...), as vLLM's `chat_template_kwargs`.
    """
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
    )
    return list(tokenizer.encode(text, add_special_tokens=False))
