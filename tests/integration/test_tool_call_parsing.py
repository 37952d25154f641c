"""`tool_call_parser`: vLLM's parsers turn completion text into OpenAI tool calls for two model families.

The tiny tokenizer carries hermes' `<tool_call>` markers; `pythonic` (Llama 3.2/4 style
`[name(arg=value)]`) needs no marker, so both families parse with the same tokenizer here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.rollout.gateway import InvalidRequest, chat_request
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


def _request(parsing: ToolCallParsing, tools: list[dict[str, Any]], tool_choice: Any) -> Any:
    body: dict[str, Any] = {"messages": MESSAGES, "tools": tools}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    return parsing.adjust(chat_request(body))


def _calls(calls: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    assert all(c["type"] == "function" and c["id"] for c in calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_calls_content_and_malformed_output(tokenizer: Any) -> None:
    parsing = ToolCallParsing("hermes", tokenizer)
    request = _request(parsing, TOOLS, None)
    assert request.tool_choice == "auto" and request.extract_structured_outputs() is None
    assert request.skip_special_tokens is False  # hermes keeps its markers in the text, as vLLM serves it
    text = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    content, calls = parsing.parse(text, request)
    assert content == "Let me check. " and _calls(calls) == [("get_weather", {"city": "Paris"})]
    assert parsing.parse("It is sunny.", request) == ("It is sunny.", [])
    malformed = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert parsing.parse(malformed, request) == (malformed, [])
    # What validation's `agent/format_valid_turns` counts: markup left unread, or a call to no offered tool.
    assert parsing.well_formed(content, calls, request) and parsing.well_formed("It is sunny.", [], request)
    assert not parsing.well_formed(*parsing.parse(malformed, request), request)
    unknown = parsing.parse('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', request)
    assert unknown[1] and not parsing.well_formed(*unknown, request)


def test_pythonic_calls(tokenizer: Any) -> None:
    parsing = ToolCallParsing("pythonic", tokenizer)
    request = _request(parsing, TOOLS, "auto")
    content, calls = parsing.parse('[get_weather(city="Paris"), get_weather(city="Oslo")]', request)
    assert content is None
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert parsing.parse("It is sunny.", request) == ("It is sunny.", [])


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_required_and_named_choices_constrain_sampling_to_a_call(tokenizer: Any, tool_choice: Any) -> None:
    parsing = ToolCallParsing("hermes", tokenizer)
    request = _request(parsing, TOOLS, tool_choice)
    constraint = request.extract_structured_outputs()
    # hermes constrains the call in its own markup: the grammar opens `<tool_call>` and the named
    # function (or any of the tools), so what is sampled parses as a call.
    assert constraint is not None and constraint.structural_tag is not None
    assert "<tool_call>" in constraint.structural_tag and "get_weather" in constraint.structural_tag
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parsing.parse(text, request)
    assert content is None and _calls(calls) == [("get_weather", {"city": "Oslo"})]


def test_auto_and_none_leave_sampling_free(tokenizer: Any) -> None:
    parsing = ToolCallParsing("hermes", tokenizer)
    assert _request(parsing, TOOLS, "auto").extract_structured_outputs() is None
    assert chat_request({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"}).tool_choice == "none"


def test_tools_vllm_refuses_are_refused(tokenizer: Any) -> None:
    with pytest.raises(InvalidRequest) as nameless:
        chat_request(
            {"messages": MESSAGES, "tools": [{"type": "function", "function": {"description": "x"}}]}
        )
    assert nameless.value.param.startswith("tools")
    with pytest.raises(InvalidRequest) as unknown:
        chat_request(
            {
                "messages": MESSAGES,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            }
        )
    assert unknown.value.param == "tool_choice"
    with pytest.raises(InvalidRequest) as choice_without_tools:
        chat_request({"messages": MESSAGES, "tool_choice": "required"})
    assert choice_without_tools.value.param == "tool_choice"
