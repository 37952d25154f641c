"""`tool_call_parser`: vLLM's parsers turn completion text into OpenAI tool calls for two model families.

The tiny tokenizer carries hermes' `<tool_call>` markers; `pythonic` (Llama 3.2/4 style
`[name(arg=value)]`) needs no marker, so both families parse with the same tokenizer here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.rollout.tool_calls import ToolCallParsing

pytestmark = pytest.mark.integration

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_models: TinyModels) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_models.student))


def _calls(calls: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    assert all(c["type"] == "function" and c["id"] for c in calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_calls_content_and_malformed_output(tokenizer: Any) -> None:
    parsing = ToolCallParsing("hermes", tokenizer)
    request = parsing.request(MESSAGES, TOOLS, None)
    assert request.skip_special_tokens is False  # hermes keeps its markers in the text, as vLLM serves it
    text = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    content, calls = parsing.parse(text, request)
    assert content == "Let me check. " and _calls(calls) == [("get_weather", {"city": "Paris"})]
    assert parsing.parse("It is sunny.", request) == ("It is sunny.", [])
    malformed = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert parsing.parse(malformed, request) == (malformed, [])


def test_pythonic_calls(tokenizer: Any) -> None:
    parsing = ToolCallParsing("pythonic", tokenizer)
    request = parsing.request(MESSAGES, TOOLS, "auto")
    content, calls = parsing.parse('[get_weather(city="Paris"), get_weather(city="Oslo")]', request)
    assert content is None
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert parsing.parse("It is sunny.", request) == ("It is sunny.", [])


def test_tools_vllm_refuses_are_refused(tokenizer: Any) -> None:
    parsing = ToolCallParsing("hermes", tokenizer)
    with pytest.raises(ValidationError):
        parsing.request(MESSAGES, [{"type": "function", "function": {"description": "no name"}}], None)
