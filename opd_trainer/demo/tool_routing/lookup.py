"""Lookup episodes on the tool-routing tools: a chain of calls whose early mistakes are the agent's own.

The user names an item by what it is ("Alice's blue lamp"), never by its id. The agent must first call
`find_item` with that name, whose result gives the item's id, then call the movable tool
(`task.MOVABLE_TOOLS`) with exactly that id and the other arguments, then summarise the result in plain
text. The backend (`run_tool`) knows only the episode's item (`rollout_extra.items`, name -> id), so a
wrong early turn is the agent's fault and answered with an error saying what was wrong:

- skipping the lookup and guessing an id, or using an id other than the one returned: `no item K-1234`;
- looking up another name: `no item named Bob's red lamp`.

The agent repairs either by looking the named item up again and calling on the id that returned; the
variant's training turns show that repair after an id error (`TRAINED_MISTAKES`).

Scoring (`score_episode`, the example's reward): the episode succeeds when the final state is right,
the exact expected call on the looked-up id was accepted and no other call changed that item, and the
last reply is plain text naming the id and the result (the status, or the new priority). A clean run
(exactly the two expected calls) scores 1.0, a run that succeeded after repairing errors 0.75, the
right state without that answer 0.25, anything else 0 (`EpisodeScore.reward`).

`make_episodes` writes the records (the opening only; the agent plays the rest against `run_tool`);
`make_injected_episodes` writes records whose opening already holds one of `MISTAKES` made and answered
with the backend's error (TurnSight's self-correction subset: the agent is judged on the turns after it);
`make_samples` writes the training turns of the `lookup` tiny-model variant: the lookup, the call with
the returned id, the repair after an error and the summary (`LOOKUP_CATEGORIES`). Both bucket a
conversation by its opening (system prompt and first user turn) into the task's splits, so no
validation episode's opening appears in any training turn.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from opd_trainer.demo.tool_routing import self_correction, task

LOOKUP_TOOL = "find_item"
_FIND_ITEM = {
    "type": "function",
    "function": {
        "name": LOOKUP_TOOL,
        "description": "Find an item by its name; returns its item_id.",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    },
}
TOOLS: list[dict[str, Any]] = [*task.TOOLS, _FIND_ITEM]
TOOL_NAMES: frozenset[str] = frozenset(t["function"]["name"] for t in TOOLS)
SYSTEM_PROMPT = (
    task.SYSTEM_PROMPT + " When the user names an item instead of giving its item_id, first call "
    "find_item with that name and then use exactly the item_id it returns."
)
# The decision each training turn takes: the lookup, the call on the returned id, a turn right after an
# error (the repair), the summary of the result.
LOOKUP_CATEGORIES: tuple[str, ...] = ("lookup", "call", "repair", "summary")
MISTAKES: tuple[str, ...] = ("skipped_lookup", "wrong_name", "wrong_id")
# The mistakes the training turns repair. A wrong name's repair is left out (its turn would copy the name
# from the request past a wrong one just used); the backend and the judge still punish a wrong name.
TRAINED_MISTAKES: tuple[str, ...] = ("skipped_lookup", "wrong_id")
# Share of training conversations of the other categories whose history holds a repaired mistake.
MISTAKE_SHARE = 0.3

_COLOURS = {
    "en": ("blue", "red", "green", "black", "white", "grey"),
    "zh": ("蓝色", "红色", "绿色", "黑色", "白色", "灰色"),
}
_THINGS = {
    "en": ("lamp", "chair", "desk", "monitor", "keyboard", "printer", "router", "headset"),
    "zh": ("台灯", "椅子", "书桌", "显示器", "键盘", "打印机", "路由器", "耳机"),
}
_OWNERS = {
    "en": ("Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry"),
    "zh": ("小王", "小李", "张伟", "李娜", "王芳", "刘洋", "陈静", "赵磊"),
}
_NAME = {"en": "{owner}'s {colour} {thing}", "zh": "{owner}的{colour}{thing}"}
# A Chinese request quotes the name (「...」): the tiny tokenizer's pre-tokenizer splits only at spaces and
# punctuation, so an unquoted name merges with the words around it into tokens that never appear in the
# call's `"name": "..."`, and the model cannot copy it (the first builds: every Chinese lookup wrong).
_REQUESTS: dict[str, dict[str, tuple[str, ...]]] = {
    "query_status": {
        "en": (
            "What is the status of {name}?",
            "Check the status of {name}.",
            "Can you look up {name} for me?",
        ),
        "zh": ("查询「{name}」的状态。", "「{name}」现在是什么状态？", "帮我看看「{name}」的进度。"),
    },
    "update_priority": {
        "en": ("Set the priority of {name} to {priority}.", "Change {name} to {priority} priority."),
        "zh": ("把「{name}」的优先级设为{priority}。", "「{name}」的优先级改成{priority}。"),
    },
}


def item_names(lang: task.Lang) -> list[str]:
    """Every item name of `lang` (owner, colour and thing)."""
    return [
        _NAME[lang].format(owner=o, colour=c, thing=t)
        for o in _OWNERS[lang]
        for c in _COLOURS[lang]
        for t in _THINGS[lang]
    ]


def no_item_error(item_id: str) -> dict[str, str]:
    return {"error": f"no item {item_id}"}


def no_name_error(name: str) -> dict[str, str]:
    return {"error": f"no item named {name}"}


def found(name: str, item_id: str) -> dict[str, str]:
    """`find_item`'s result."""
    return {"name": name, "item_id": item_id}


def run_tool(name: str, arguments: dict[str, Any], items: dict[str, str]) -> str:
    """The episode's tool backend over its items (name -> id), as JSON text: a lookup's result, a movable
    tool's result on a known id, else an error naming what was wrong."""
    if name == LOOKUP_TOOL:
        wanted = str(arguments.get("name", ""))
        result = found(wanted, items[wanted]) if wanted in items else no_name_error(wanted)
        return json.dumps(result, ensure_ascii=False)
    item = str(arguments.get("item_id", ""))
    if name in task.MOVABLE_TOOLS and item not in items.values():
        return json.dumps(no_item_error(item), ensure_ascii=False)
    return self_correction.run_tool(name, arguments, {})


@dataclass(frozen=True)
class _Episode:
    """What one episode is about: the request and the calls that fulfil it."""

    lang: task.Lang
    tool: str
    name: str
    args: dict[str, str]  # the movable call's arguments, item_id the one `find_item` returns
    opening: list[dict[str, Any]]

    @property
    def calls(self) -> list[dict[str, Any]]:
        return [
            {"name": LOOKUP_TOOL, "arguments": {"name": self.name}},
            {"name": self.tool, "arguments": self.args},
        ]


def _episode(rng: random.Random) -> _Episode:
    lang: task.Lang = rng.choice(("en", "zh"))
    tool = rng.choice(task.MOVABLE_TOOLS)
    args = task.arguments_for(rng, tool, lang)
    name = rng.choice(item_names(lang))
    user = rng.choice(_REQUESTS[tool][lang]).format(name=name, **args)
    return _Episode(lang, tool, name, args, [{"role": "user", "content": user}])


def _messages(opening: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, *opening]


def make_episodes(split: task.Split, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` distinct episode records of `split`.

    `rollout_extra.solution` is `{"decision": "tool_call", "tool_calls": [find_item, the movable call]}`
    (the clean chain), so agent-level tool-call accuracy reads it; `items` maps the named item to its id
    for the tool backend; `category` is the movable tool.
    """
    rng = random.Random(f"lookup:{split}:{seed}")
    records: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _ in range(100 * n + 1000):
        if len(records) == n:
            return records
        episode = _episode(rng)
        messages = _messages(episode.opening)
        key = task.canonical(messages)
        if key in seen or task.split_of(messages) != split:
            continue
        seen.add(key)
        solution = {"decision": "tool_call", "tool_calls": episode.calls}
        records.append(
            {
                "messages": messages,
                "tools": TOOLS,
                "rollout_extra": {
                    "sample_id": f"{split}-{len(records):06d}",
                    "category": episode.tool,
                    "solution": json.dumps(solution, ensure_ascii=False, sort_keys=True),
                    "items": {episode.name: episode.args["item_id"]},
                },
            }
        )
    raise ValueError(f"could not generate {n} distinct {split} episodes")


# The injected history's call ids: apart from any id the gateway gives the agent's own calls, so the
# agent-level metrics never take an injected answer for one of the agent's.
INJECTED_CALL_ID = "call_injected_{}"


def _injected_history(rng: random.Random, episode: _Episode, mistake: str) -> list[dict[str, Any]]:
    """The turns of `mistake` already made, each answered by the backend, the last with its error:
    `skipped_lookup` a guessed id; `wrong_name` a lookup of another name; `wrong_id` the right lookup,
    then a call on an id other than the one it returned."""
    lookup, _ = episode.calls
    wrong_call = {
        "name": episode.tool,
        "arguments": {
            **episode.args,
            "item_id": task.new_item_id(rng, episode.lang, episode.args["item_id"]),
        },
    }
    chain = {
        "skipped_lookup": [wrong_call],
        "wrong_name": [{"name": LOOKUP_TOOL, "arguments": {"name": _other_name(rng, episode)}}],
        "wrong_id": [lookup, wrong_call],
    }[mistake]
    turns: list[dict[str, Any]] = []
    for index, call in enumerate(chain):
        call_id = INJECTED_CALL_ID.format(index)
        turns += [_assistant_call(call, call_id), _result(episode, call, call_id)]
    return turns


def make_injected_episodes(
    split: task.Split, n: int, seed: int = 0, mistakes: tuple[str, ...] = MISTAKES
) -> list[dict[str, Any]]:
    """`n` distinct episode records of `split` whose opening already holds a wrong turn answered with
    the backend's error (`mistakes` cycle evenly; `rollout_extra.mistake` names it): TurnSight's
    self-correction subset, which validation's `agent/self_correction_success` reads (a history holding
    a tool error).

    The split is the request's (system prompt and user turn), as `make_episodes`'s, so no training turn
    shares it. The rollout hands the whole opening to the agent and the judge reads only what comes
    after it (`score_episode`'s `start`): the injected call is never the agent's own, its error is not
    counted, and success means the agent repaired it, reaching the right final state and answer (a
    clean repair, lookup then call, scores 1.0; after `wrong_id` the call on the id the history's lookup
    returned also succeeds, at 0.75). `solution` is the clean chain, as `make_episodes`'s."""
    rng = random.Random(f"lookup_injected:{split}:{seed}")
    records: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _ in range(100 * n + 1000):
        if len(records) == n:
            return records
        mistake = mistakes[len(records) % len(mistakes)]
        episode = _episode(rng)
        if task.split_of(_messages(episode.opening)) != split:
            continue
        messages = _messages([*episode.opening, *_injected_history(rng, episode, mistake)])
        key = task.canonical(messages)
        if key in seen:
            continue
        seen.add(key)
        solution = {"decision": "tool_call", "tool_calls": episode.calls}
        records.append(
            {
                "messages": messages,
                "tools": TOOLS,
                "rollout_extra": {
                    "sample_id": f"{split}-injected-{len(records):06d}",
                    "category": episode.tool,
                    "mistake": mistake,
                    "solution": json.dumps(solution, ensure_ascii=False, sort_keys=True),
                    "items": {episode.name: episode.args["item_id"]},
                },
            }
        )
    raise ValueError(f"could not generate {n} distinct injected {split} episodes")


def _assistant_call(call: dict[str, Any], call_id: str = "call_0") -> dict[str, Any]:
    fn = {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "type": "function", "function": fn}],
    }


def _text(content: str) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def _result(episode: _Episode, call: dict[str, Any], call_id: str = "call_0") -> dict[str, Any]:
    content = run_tool(call["name"], call["arguments"], {episode.name: episode.args["item_id"]})
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _other_name(rng: random.Random, episode: _Episode) -> str:
    return rng.choice([n for n in item_names(episode.lang) if n != episode.name])


def _turns(
    rng: random.Random, episode: _Episode, mistake: str | None
) -> tuple[list[dict[str, Any]], int | None]:
    """The whole conversation after the opening (assistant turns and tool results, ending with the
    summary) with `mistake` (one of `MISTAKES`) made and repaired on the way, and the mistake's index.
    The repair is always to look the item up again, then call on the id that lookup returned (the latest
    id in the context)."""
    lookup, action = episode.calls
    wrong_id = task.new_item_id(rng, episode.lang, episode.args["item_id"])
    wrong_call = {"name": episode.tool, "arguments": {**episode.args, "item_id": wrong_id}}
    chain: list[dict[str, Any]] = {
        None: [lookup, action],
        "skipped_lookup": [wrong_call, lookup, action],
        "wrong_name": [
            {"name": LOOKUP_TOOL, "arguments": {"name": _other_name(rng, episode)}},
            lookup,
            action,
        ],
        "wrong_id": [lookup, wrong_call, lookup, action],
    }[mistake]
    turns: list[dict[str, Any]] = []
    for call in chain:
        turns += [_assistant_call(call), _result(episode, call)]
    outcome = json.loads(turns[-1]["content"])
    summary = task.SUMMARY_REPLY[episode.tool][episode.lang].format(**{**episode.args, **outcome})
    at = None if mistake is None else 2 if mistake == "wrong_id" else 0
    return [*turns, _text(summary)], at


def _category(history: list[dict[str, Any]], reference: dict[str, Any]) -> str:
    last = history[-1]
    if last["role"] == "tool" and "error" in json.loads(last["content"]):
        return "repair"
    if not reference.get("tool_calls"):
        return "summary"
    return "lookup" if reference["tool_calls"][0]["function"]["name"] == LOOKUP_TOOL else "call"


def _sample(
    rng: random.Random, category: str
) -> tuple[_Episode, list[dict[str, Any]], dict[str, Any]] | None:
    """(episode, history after the system prompt, reference turn) of one training turn of `category`,
    or None when this conversation has no such turn."""
    episode = _episode(rng)
    repairing = category == "repair" or rng.random() < MISTAKE_SHARE
    mistake = rng.choice(TRAINED_MISTAKES) if repairing else None
    turns, wrong = _turns(rng, episode, mistake)
    messages = [*episode.opening, *turns]
    offset = len(episode.opening)
    # A mistake's own turn is never a reference: the model learns only the turns of a correct agent.
    cuts = [
        i
        for i, m in enumerate(messages)
        if m["role"] == "assistant" and i - offset != wrong and _category(messages[:i], m) == category
    ]
    if not cuts:
        return None
    at = rng.choice(cuts)
    return episode, messages[:at], messages[at]


def make_samples(split: task.Split, n: int, seed: int = 0) -> list[task.Sample]:
    """`n` distinct training turns of `split`, deterministic in (split, n, seed); `LOOKUP_CATEGORIES`
    cycle evenly. `solution` is the reference turn's (`task.solution_of`)."""
    rng = random.Random(f"lookup_samples:{split}:{seed}")
    samples: list[task.Sample] = []
    seen: set[str] = set()
    for _ in range(100 * n + 1000):
        if len(samples) == n:
            return samples
        category = LOOKUP_CATEGORIES[len(samples) % len(LOOKUP_CATEGORIES)]
        drawn = _sample(rng, category)
        if drawn is None:
            continue
        episode, history, reference = drawn
        messages = _messages(history)
        key = task.canonical(messages)
        if key in seen or task.split_of(_messages(episode.opening)) != split:
            continue
        seen.add(key)
        decision = "tool_call" if reference.get("tool_calls") else "no_tool"
        extra = {
            "sample_id": f"{split}-{len(samples):06d}",
            "category": category,
            "solution": task.solution_of(reference, decision),
        }
        samples.append(task.Sample({"messages": messages, "tools": TOOLS, "rollout_extra": extra}, reference))
    raise ValueError(f"could not generate {n} distinct {split} samples")


@dataclass(frozen=True)
class EpisodeScore:
    calls_correct: bool  # the final state is right: the expected call on the looked-up id, nothing else
    answered: bool  # the last reply is plain text naming the id and the result
    errors: int  # tool results that were errors (each the agent's own mistake)
    clean: bool  # exactly the two expected calls, in order

    @property
    def success(self) -> bool:
        return self.calls_correct and self.answered

    @property
    def reward(self) -> float:
        """1.0 clean success, 0.75 success after repairs, 0.25 right state without the answer, else 0."""
        if self.success:
            return 1.0 if self.clean else 0.75
        return 0.25 if self.calls_correct else 0.0


def score_episode(messages: list[dict[str, Any]], start: int, solution: str | dict[str, Any]) -> EpisodeScore:
    """Judge the conversation after its first `start` messages (the opening) against `solution`; a
    lookup of the named item in the opening (an injected history) counts as made."""
    lookup, expected = (json.loads(solution) if isinstance(solution, str) else solution)["tool_calls"]
    after = messages[start:]
    turns = [m for m in after if m.get("role") == "assistant"]
    made = [call for turn in turns for call in self_correction.assistant_calls(turn)]
    # An opening's own calls (an injected history, `make_injected_episodes`) are not the agent's: they
    # count only as a lookup already answered, never as a call that changed the item.
    given = [
        call
        for m in messages[:start]
        if m.get("role") == "assistant"
        for call in self_correction.assistant_calls(m)
    ]
    item_id = expected["arguments"]["item_id"]
    # The backend accepts movable calls only on the episode's item: those are what changed its state.
    on_item = [
        c
        for c in made
        if c["name"] in task.MOVABLE_TOOLS
        and isinstance(c["arguments"], dict)
        and c["arguments"].get("item_id") == item_id
    ]
    first = made.index(expected) if expected in made else None
    looked_up = first is not None and lookup in given + made[:first]
    calls_correct = looked_up and bool(on_item) and all(c == expected for c in on_item)
    result = json.loads(self_correction.run_tool(expected["name"], expected["arguments"], {}))
    named = [item_id, result.get("status") or expected["arguments"].get("priority", "")]
    last = turns[-1] if turns else {}
    text = str(last.get("content") or "")
    answered = bool(last) and not last.get("tool_calls") and all(v in text for v in named)
    errors = sum(1 for m in after if m.get("role") == "tool" and _is_error(m.get("content")))
    return EpisodeScore(calls_correct, answered, errors, made == [lookup, expected])


def _is_error(content: Any) -> bool:
    try:
        parsed = json.loads(content)
    except (TypeError, json.JSONDecodeError):
        return False
    return isinstance(parsed, dict) and "error" in parsed
