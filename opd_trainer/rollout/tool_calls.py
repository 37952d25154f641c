"""Tool calls in a completion, decided and parsed by vLLM's own parser for the model family.

The gateway answers like `vllm serve --enable-auto-tool-choice --tool-call-parser NAME` would: the
same registry of parsers (`hermes` for Qwen2.5/Qwen3 and Hermes, `llama3_json`, `mistral`,
`pythonic`, `qwen3_xml`, ...), composed by vLLM's `ParserManager` into the `Parser` its OpenAI server
uses, so `tool_choice` means what it means there:
- `auto`: the model decides; its native call markup is parsed out of the text.
- `required` / a named function: the parser asks for constrained decoding (a JSON schema the
  engine's structured-output backend enforces token by token): a list of `{name, parameters}` for
  `required`, the named function's arguments for a named choice. Parsers that read such calls in
  their own format (vLLM's `supports_required_and_named = False`) fall back to `auto`, as in vLLM.
- `none`: the gateway renders no tools and parses none (`Gateway`, not here).
Output a parser cannot read stays in `content` with no tool call, as vLLM answers it: a model in
training emits malformed calls often, and that is data.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from opd_trainer.errors import ConfigError

FIELD = "tool_call_parser"


class ToolCallParsing:
    """One model's composed parser class, checked against its tokenizer once; an instance per call."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        # Lazy: vLLM/transformers/uvicorn load in the gateway's actor, not where this module is imported.
        from vllm.parser import ParserManager
        from vllm.tool_parsers import ToolParserManager

        if name not in ToolParserManager.list_registered():
            known = ", ".join(sorted(ToolParserManager.list_registered()))
            raise ConfigError(f"unknown tool-call parser {name!r}; vLLM has: {known}", field=FIELD)
        try:
            parser_class = ParserManager.get_parser(
                tool_parser_name=name, enable_auto_tools=True, tokenizer=tokenizer
            )
        except Exception as exc:  # parsers check the tokenizer for their markers when built
            raise ConfigError(
                f"the {name!r} tool-call parser does not fit the model's tokenizer: {exc}", field=FIELD
            ) from None
        assert parser_class is not None and parser_class.tool_parser_cls is not None
        self._parser_class = parser_class
        # vLLM logs each unreadable call with a traceback; here they are expected data (counted by
        # what the rollout's reward and evaluator make of the reply), not server errors.
        logging.getLogger(parser_class.tool_parser_cls.__module__).setLevel(logging.CRITICAL)
        self.name = name
        self._tokenizer = tokenizer
        # Where a parser declares its call marker (hermes: "<tool_call>"), one left in the content
        # is a call it could not read.
        self._call_marker: str | None = getattr(parser_class.tool_parser_cls, "tool_call_start_token", None)

    def adjust(self, request: Any) -> Any:
        """vLLM's `ChatCompletionRequest` adjusted by the parser as vLLM's server does: its
        `skip_special_tokens` says how the completion must be decoded, its structured outputs (none
        under `auto`) what the engine must constrain sampling to."""
        return self._parser_class(self._tokenizer, request.tools).adjust_request(request)

    def parse(self, text: str, request: Any) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, OpenAI tool calls) of a completion's text, for the `request` it answers."""
        # Lazy: vLLM/transformers/uvicorn load in the gateway's actor, not where this module is imported.
        from vllm.entrypoints.generate.base.protocol import ToolCall
        from vllm.renderers.chat_utils import make_tool_call_id

        parser = self._parser_class(self._tokenizer, request.tools)
        _, content, calls = parser.parse(text, request, enable_auto_tools=True)
        if not calls:
            return content, []
        tool_calls = [
            ToolCall(id=call.id or make_tool_call_id(), function=call).model_dump(
                mode="json", include={"id", "type", "function"}
            )
            for call in calls
        ]
        return content or None, tool_calls

    def well_formed(self, content: str | None, tool_calls: list[dict[str, Any]], request: Any) -> bool:
        """Whether a parsed reply is well formed: no call marker left in its content, and every call
        names one of the request's tools with a JSON object of arguments."""
        if self._call_marker and content and self._call_marker in content:
            return False
        offered = {tool.function.name for tool in request.tools or []}
        for call in tool_calls:
            function = call.get("function", {})
            if function.get("name") not in offered:
                return False
            try:
                arguments = json.loads(function.get("arguments") or "{}")
            except ValueError:
                return False
            if not isinstance(arguments, dict):
                return False
        return True
