"""Synthetic tool-routing task: `task` (deterministic JSONL samples), `evaluator` (parse, score and
aggregate replies), `lookup` (lookup episodes: a chain of calls whose early mistakes are the agent's own)
and `self_correction` (episodes where the agent must correct a call after an error)."""

from opd_trainer.demo.tool_routing.evaluator import (
    ParsedReply,
    ReplyScore,
    ToolCall,
    aggregate,
    evaluate_texts,
    format_reply,
    message_to_parsed,
    parse_reply,
    score_reply,
)
from opd_trainer.demo.tool_routing.task import (
    CATEGORIES,
    SYSTEM_PROMPT,
    TOOL_NAMES,
    TOOLS,
    Sample,
    make_samples,
)

__all__ = [
    "CATEGORIES",
    "SYSTEM_PROMPT",
    "TOOLS",
    "TOOL_NAMES",
    "ParsedReply",
    "ReplyScore",
    "Sample",
    "ToolCall",
    "aggregate",
    "evaluate_texts",
    "format_reply",
    "make_samples",
    "message_to_parsed",
    "parse_reply",
    "score_reply",
]
