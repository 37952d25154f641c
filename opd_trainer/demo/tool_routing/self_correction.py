"""Self-correction episodes on the tool-routing tools (TurnSight's self-correction test, built on disk).

An episode is a user request for a movable tool (`task.MOVABLE_TOOLS`) with every argument given. In
about half of them the item has moved: the agent's first, correct-looking call gets an error naming the
new id (`task.moved_error`), and the agent must correct itself by making the same call on the new id.
A successful call returns a result the agent must then summarise in plain text. The episode succeeds
when the agent made exactly the expected calls in order and its final reply names the final item.

`make_episodes` writes the records (the opening conversation only; the agent plays the rest against
`run_tool`), `score_episode` judges a finished conversation. The tiny models of the `self_correction`
variant (`build_tiny_models(..., variant="self_correction")`) are trained on every turn of such
episodes, including the correction (`task.SELF_CORRECTION_CATEGORIES`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from opd_trainer.demo.tool_routing import task

MOVED_SHARE = 0.5


def _calls(tool: str, args: dict[str, str], new_id: str | None) -> list[dict[str, Any]]:
    first = {"name": tool, "arguments": args}
    return [first] if new_id is None else [first, {"name": tool, "arguments": {**args, "item_id": new_id}}]


def make_episodes(split: task.Split, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` distinct episode records of `split` (openings hashed into the task's own split buckets).

    `rollout_extra.solution` is `{"decision": "tool_call", "tool_calls": [...]}` with the calls in order
    (two when the item moved), so agent-level tool-call accuracy reads it; `moved` maps the requested id
    to its new one (empty when the item did not move) for the tool backend.
    """
    rng = random.Random(f"self_correction:{split}:{seed}")
    records: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _ in range(100 * n + 1000):
        if len(records) == n:
            return records
        lang: task.Lang = rng.choice(("en", "zh"))
        tool = rng.choice(task.MOVABLE_TOOLS)
        args = task.arguments_for(rng, tool, lang)
        opening = task.opening(rng, lang, tool, args, None)
        messages = [{"role": "system", "content": task.SYSTEM_PROMPT}, *opening]
        key = task.canonical(messages)
        if key in seen or task.split_of(messages) != split:
            continue
        seen.add(key)
        new_id = task.new_item_id(rng, lang, args["item_id"]) if rng.random() < MOVED_SHARE else None
        solution = {"decision": "tool_call", "tool_calls": _calls(tool, args, new_id)}
        records.append(
            {
                "messages": messages,
                "tools": task.TOOLS,
                "rollout_extra": {
                    "sample_id": f"{split}-{len(records):06d}",
                    "category": "moved" if new_id else "direct",
                    "solution": json.dumps(solution, ensure_ascii=False, sort_keys=True),
                    "moved": {args["item_id"]: new_id} if new_id else {},
                },
            }
        )
    raise ValueError(f"could not generate {n} distinct {split} episodes")


def run_tool(name: str, arguments: dict[str, Any], moved: dict[str, str]) -> str:
    """The episode's tool backend: a moved item's error, else the tool's result (as JSON text)."""
    if name not in task.MOVABLE_TOOLS:
        return json.dumps({"error": f"tool {name} is not available here"})
    item = str(arguments.get("item_id", ""))
    if item in moved:
        return json.dumps(task.moved_error(item, moved[item]), ensure_ascii=False)
    args = {k: str(v) for k, v in arguments.items()}
    status = task.STATUSES[sum(map(ord, item)) % len(task.STATUSES)]
    return json.dumps(task.tool_result(name, args, status), ensure_ascii=False)


@dataclass(frozen=True)
class EpisodeScore:
    calls_correct: bool  # exactly the expected calls, in order
    answered: bool  # the last reply is plain text naming the final item id
    hit_moved_error: bool
    self_corrected: bool  # after the moved error, the next turn was the corrected call

    @property
    def success(self) -> bool:
        return self.calls_correct and self.answered


def assistant_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant turn's calls as `{name, arguments}` (arguments None where they are not JSON)."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {})
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            arguments = None
        calls.append({"name": function.get("name"), "arguments": arguments})
    return calls


def score_episode(messages: list[dict[str, Any]], start: int, solution: str | dict[str, Any]) -> EpisodeScore:
    """Judge the conversation after its first `start` messages (the opening) against `solution`."""
    expected = (json.loads(solution) if isinstance(solution, str) else solution)["tool_calls"]
    turns = [m for m in messages[start:] if m.get("role") == "assistant"]
    made = [call for turn in turns for call in assistant_calls(turn)]
    final_id = expected[-1]["arguments"]["item_id"]
    last = turns[-1] if turns else {}
    answered = bool(last) and not last.get("tool_calls") and final_id in str(last.get("content") or "")
    moved_at = next(
        (i for i, turn in enumerate(turns) if len(expected) == 2 and assistant_calls(turn) == expected[:1]),
        None,
    )
    after = turns[moved_at + 1] if moved_at is not None and moved_at + 1 < len(turns) else None
    corrected = after is not None and assistant_calls(after) == expected[1:]
    return EpisodeScore(
        calls_correct=made == expected,
        answered=answered,
        hit_moved_error=moved_at is not None,
        self_corrected=corrected,
    )


def make_injected_episodes(split: task.Split, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` distinct moved-item episodes of `split` whose opening already holds the first call and the
    moved item's error (TurnSight's self-correction subset: a history holding a tool error, which
    validation's `agent/self_correction_success` reads). The agent's part is the correction: the same
    call on the new id, then the summary; `solution` lists that one remaining call, and `score_episode`
    judges only what follows the opening, so the injected call is never counted as the agent's."""
    records: list[dict[str, Any]] = []
    # Moved episodes of a larger draw of this split (about half are moved), in their own sample ids.
    for record in make_episodes(split, 4 * n + 16, seed=seed + 7919):
        if len(records) == n:
            return records
        extra = record["rollout_extra"]
        first, *rest = json.loads(extra["solution"])["tool_calls"]
        if not rest:
            continue
        call_id = "call_injected_0"
        function = {"name": first["name"], "arguments": json.dumps(first["arguments"], ensure_ascii=False)}
        history = [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": call_id, "type": "function", "function": function}],
            },
            {
                "role": "tool",
                "tool_call_id": call_id,
                "content": run_tool(first["name"], first["arguments"], extra["moved"]),
            },
        ]
        solution = {"decision": "tool_call", "tool_calls": rest}
        records.append(
            {
                "messages": [*record["messages"], *history],
                "tools": record["tools"],
                "rollout_extra": {
                    **extra,
                    "sample_id": f"{split}-injected-{len(records):06d}",
                    "category": "injected",
                    "solution": json.dumps(solution, ensure_ascii=False, sort_keys=True),
                },
            }
        )
    raise ValueError(f"could not generate {n} injected {split} episodes")
