"""What an LLM call did, as an action rather than as tokens: its tool calls (name and arguments decoded,
compared canonically), or, for a plain reply, its text normalised.

Two replies that differ only in wording, spacing or the order of a JSON object's keys are the same
action; TurnSight pairs turns on actions (its section 5.4: a pair whose sides differ only in wording
teaches nothing but sharper probabilities). One definition, read by the preference mining
(`signal/pairs.py`) and the agent metrics (`rollout/agent_eval.py`).
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

from opd_trainer.records import LLMCall

Action = tuple[str, ...]
"""("tool_calls", canonical call, ...) or ("reply", normalised text)."""


def tool_call_function(call: dict[str, Any]) -> tuple[str, Any]:
    """(name, arguments decoded) of a tool call in OpenAI's shape or the flat `{name, arguments}`."""
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # undecodable: compared as the text it is
            arguments = json.loads(arguments or "{}")
    return str(function.get("name", "")), arguments


def canonical_tool_call(call: dict[str, Any]) -> str:
    """A tool call as one string: its name and decoded arguments, keys sorted."""
    return json.dumps(tool_call_function(call), sort_keys=True, ensure_ascii=False)


def normalised_text(text: str) -> str:
    """Case-folded, whitespace collapsed, trailing punctuation dropped."""
    return re.sub(r"\s+", " ", text).strip().rstrip(".!?。！？").strip().casefold()


def action_of(call: LLMCall) -> Action:
    """The call's action: its tool calls in order when it made any (the text beside them is wording),
    else its reply's normalised text."""
    tool_calls = call.response_message.get("tool_calls") or []
    if tool_calls:
        return ("tool_calls", *(canonical_tool_call(c) for c in tool_calls))
    text = call.response_message.get("content")
    if not isinstance(text, str):
        text = call.text
    return ("reply", normalised_text(text))
