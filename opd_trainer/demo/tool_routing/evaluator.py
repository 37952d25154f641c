"""Tool-routing evaluator: parse a model reply, score it against a sample's solution, aggregate metrics.

Pure functions over strings and dicts, shared by validation during training and by reward code.
A reply is hermes style: zero or more ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
blocks, anything else is text whose decision is read from the task's reply conventions.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from opd_trainer.demo.tool_routing.task import CLARIFY_MARKERS, CONFIRM_MARKERS, TOOL_NAMES

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(_OPEN) + r"(.*?)" + re.escape(_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedReply:
    """What a reply decided; `tool_calls` holds only calls that parsed to a string name and dict arguments."""

    decision: str
    tool_calls: tuple[ToolCall, ...]
    format_valid: bool
    text: str


@dataclass(frozen=True)
class ReplyScore:
    format_valid: bool
    decision_correct: bool
    tool_name_correct: bool
    arguments_correct: bool
    exact_match: bool


def _text_decision(text: str) -> str:
    lowered = text.lower()
    if any(m in lowered for m in CONFIRM_MARKERS):
        return "confirm"
    if any(m in lowered for m in CLARIFY_MARKERS):
        return "clarify"
    return "no_tool"


def _to_call(name: Any, arguments: Any, tool_names: Collection[str]) -> tuple[ToolCall | None, bool]:
    """(the call if it has the right shape, whether it is also a known tool)."""
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None, False
    return ToolCall(name, arguments), name in tool_names


def parse_reply(text: str, tool_names: Collection[str] = TOOL_NAMES) -> ParsedReply:
    """Parse a raw completion; an opening tag without its closing tag still counts as a tool-call attempt."""
    calls: list[ToolCall] = []
    valid = True
    for body in _BLOCK.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            valid = False
            continue
        if not isinstance(obj, dict):
            valid = False
            continue
        call, known = _to_call(obj.get("name"), obj.get("arguments"), tool_names)
        valid &= known
        if call is not None:
            calls.append(call)
    rest = _BLOCK.sub("", text)
    if _OPEN in rest or _CLOSE in rest:  # an unmatched tag: the model was cut off or lost the format
        valid = False
    if _OPEN in text:
        return ParsedReply("tool_call", tuple(calls), valid, rest.strip())
    stripped = text.strip()
    return ParsedReply(_text_decision(stripped), (), valid and bool(stripped), stripped)


def message_to_parsed(message: dict[str, Any], tool_names: Collection[str] = TOOL_NAMES) -> ParsedReply:
    """Parse an OpenAI assistant message; without structured tool_calls its content is parsed as raw text."""
    content = message.get("content") or ""
    raw_calls = message.get("tool_calls") or []
    if not raw_calls:
        return parse_reply(content, tool_names)
    calls: list[ToolCall] = []
    valid = True
    for raw in raw_calls:
        fn = raw.get("function") or {}
        try:
            arguments = json.loads(fn.get("arguments", ""))
        except (json.JSONDecodeError, TypeError):
            valid = False
            continue
        call, known = _to_call(fn.get("name"), arguments, tool_names)
        valid &= known
        if call is not None:
            calls.append(call)
    return ParsedReply("tool_call", tuple(calls), valid, content.strip())


def format_reply(message: dict[str, Any]) -> str:
    """Render an OpenAI assistant message as the hermes text a model would generate for it."""
    blocks = []
    for raw in message.get("tool_calls") or []:
        call = {"name": raw["function"]["name"], "arguments": json.loads(raw["function"]["arguments"])}
        blocks.append(f"{_OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{_CLOSE}")
    return "\n".join(([message["content"]] if message.get("content") else []) + blocks)


def _canonical_args(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def score_reply(parsed: ParsedReply, solution: str | dict[str, Any]) -> ReplyScore:
    """Score against ``{"decision", "tool_calls": [{"name", "arguments"}]}``; call order never matters.

    Arguments are judged per call as (name, canonical arguments) pairs, so the right arguments on the
    wrong tool do not count; for non-tool decisions `arguments_correct` is `decision_correct`.
    """
    sol = json.loads(solution) if isinstance(solution, str) else solution
    expected = sol["tool_calls"]
    decision_correct = parsed.decision == sol["decision"]
    names_correct = Counter(c.name for c in parsed.tool_calls) == Counter(c["name"] for c in expected)
    if sol["decision"] == "tool_call":
        got = Counter((c.name, _canonical_args(c.arguments)) for c in parsed.tool_calls)
        arguments_correct = got == Counter((c["name"], _canonical_args(c["arguments"])) for c in expected)
    else:
        arguments_correct = decision_correct
    return ReplyScore(
        parsed.format_valid,
        decision_correct,
        names_correct,
        arguments_correct,
        parsed.format_valid and decision_correct and names_correct and arguments_correct,
    )


def aggregate(scores: Sequence[ReplyScore]) -> dict[str, float]:
    """Mean of each score field over `scores`, plus their count `n` (all zeros for an empty list)."""
    n = len(scores)

    def mean(field: str) -> float:
        return sum(getattr(s, field) for s in scores) / n if n else 0.0

    return {
        "format_validity": mean("format_valid"),
        "decision_accuracy": mean("decision_correct"),
        "tool_name_accuracy": mean("tool_name_correct"),
        "argument_accuracy": mean("arguments_correct"),
        "exact_match": mean("exact_match"),
        "n": float(n),
    }


def evaluate_texts(texts: Sequence[str], records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Aggregate metrics of raw completions against the records they answer, in the same order; a call
    is well formed when it names one of its record's tools."""
    pairs = zip(texts, records, strict=True)
    return aggregate(
        [score_reply(parse_reply(t, _tool_names(r)), r["rollout_extra"]["solution"]) for t, r in pairs]
    )


def _tool_names(record: dict[str, Any]) -> frozenset[str]:
    return frozenset(t["function"]["name"] for t in record.get("tools") or []) or TOOL_NAMES
