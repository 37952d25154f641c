"""Tool calls in a completion's text, parsed by vLLM's own parser for the model family.

The gateway answers like `vllm serve --tool-call-parser NAME` would: the same registry of parsers
(`hermes` for Qwen2.5/Qwen3 and Hermes, `llama3_json`, `mistral`, `pythonic`, `qwen3_xml`, ...), the
same request adjustment (a parser may ask for special tokens to be kept in the text), and the same
split into `content` and `tool_calls`. Output a parser cannot read stays in `content` with no tool
call, as vLLM answers it: a model in training emits malformed calls often, and that is data.
"""

from __future__ import annotations

import logging
from typing import Any

from opd_trainer.errors import ConfigError

FIELD = "tool_call_parser"


class ToolCallParsing:
    """One model's parser class, checked against its tokenizer once; a parser instance per call."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        from vllm.tool_parsers import ToolParserManager

        try:
            self._parser_class = ToolParserManager.get_tool_parser(name)
        except KeyError:
            known = ", ".join(sorted(ToolParserManager.list_registered()))
            raise ConfigError(f"unknown tool-call parser {name!r}; vLLM has: {known}", field=FIELD) from None
        try:
            self._parser_class(tokenizer, None)
        except Exception as exc:  # parsers check the tokenizer for their markers when built
            raise ConfigError(
                f"the {name!r} tool-call parser does not fit the model's tokenizer: {exc}", field=FIELD
            ) from None
        # vLLM logs each unreadable call with a traceback; here they are expected data (counted by
        # what the rollout's reward and evaluator make of the reply), not server errors.
        logging.getLogger(self._parser_class.__module__).setLevel(logging.CRITICAL)
        self.name = name
        self._tokenizer = tokenizer

    def request(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], tool_choice: Any) -> Any:
        """vLLM's `ChatCompletionRequest` for a call, adjusted by the parser as vLLM's server does
        (its `skip_special_tokens` says how the completion must be decoded). Raises pydantic's
        `ValidationError` for tools vLLM would refuse."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        body = {"messages": messages, "tools": tools}
        if tool_choice is not None:
            body["tool_choice"] = tool_choice
        request = ChatCompletionRequest.model_validate(body)
        return self._parser_class(self._tokenizer, request.tools).adjust_request(request)

    def parse(self, text: str, request: Any) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, OpenAI tool calls) of a completion's text, for the `request` it answers."""
        extracted = self._parser_class(self._tokenizer, request.tools).extract_tool_calls(text, request)
        if not extracted.tools_called:
            return text, []
        calls = [
            call.model_dump(mode="json", include={"id", "type", "function"}) for call in extracted.tool_calls
        ]
        return extracted.content or None, calls
