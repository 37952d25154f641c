"""Synthetic tool-routing task: deterministic chat samples in the JSONL format users give the service.

Each record is ``{"messages", "tools", "rollout_extra": {"sample_id", "category", "solution"}}``; the
``category`` is the decision the next assistant turn must take (``tool_call``, ``clarify``, ``confirm``
or ``no_tool``) and ``solution`` is ``{"decision", "tool_calls": [{"name", "arguments"}]}`` as a JSON
string. Replies follow a few fixed templates so that the decision can be read back from plain text
(see ``CONFIRM_MARKERS`` / ``CLARIFY_MARKERS``) and a tiny model can learn them exactly.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Split = Literal["train", "validation"]
Lang = Literal["en", "zh"]
CATEGORIES: tuple[str, ...] = ("tool_call", "clarify", "confirm", "no_tool")
# The self-correction variant adds `retry`: a call failed because its item moved, the next turn must
# repeat it on the item's new id (or, once that succeeded, summarise the result).
SELF_CORRECTION_CATEGORIES: tuple[str, ...] = (*CATEGORIES, "retry")
# Checked in this order by the evaluator: a confirm reply may mention arguments, never the reverse.
CONFIRM_MARKERS: tuple[str, ...] = ("confirm", "确认")
CLARIFY_MARKERS: tuple[str, ...] = ("provide", "请提供")


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(properties)},
        },
    }


_STR = {"type": "string"}
TOOLS: list[dict[str, Any]] = [
    _tool("query_status", "Look up the status of an item.", {"item_id": _STR}),
    _tool("delete_item", "Delete an item. Destructive: confirm first.", {"item_id": _STR, "reason": _STR}),
    _tool("cancel_order", "Cancel an order. Destructive: confirm first.", {"order_id": _STR}),
    _tool(
        "update_priority",
        "Set an item's priority.",
        {"item_id": _STR, "priority": {"type": "string", "enum": ["low", "medium", "high"]}},
    ),
    _tool("create_ticket", "Create a support ticket.", {"title": _STR}),
]
# Tuples, not sets, where the generator picks from them: set order is not stable across processes.
_ALL = tuple(t["function"]["name"] for t in TOOLS)
_RISKY = ("delete_item", "cancel_order")
_SAFE = ("query_status", "update_priority", "create_ticket")
TOOL_NAMES: frozenset[str] = frozenset(_ALL)
DESTRUCTIVE: frozenset[str] = frozenset(_RISKY)

SYSTEM_PROMPT = (
    "You are a support assistant with tools. Call a tool only when every required argument is given; "
    'if one is missing, ask for it by name ("Could you provide the item_id?"). delete_item and '
    "cancel_order are destructive: first ask the user to confirm, call them only after the user says "
    "yes, and do nothing if the user says no. Otherwise answer briefly without tools. "
    "Reply in the user's language."
)

_REASONS = {
    "en": ["duplicate", "created by mistake", "no longer needed", "spam"],
    "zh": ["重复", "误建", "不再需要", "垃圾信息"],
}
_TITLES = {
    "en": ["Login page broken", "Refund request", "Slow dashboard", "Password reset"],
    "zh": ["登录页面报错", "申请退款", "仪表盘很慢", "重置密码"],
}
STATUSES = ["open", "in_progress", "shipped", "closed"]
_NAMES = {
    "en": ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry"],
    "zh": ["小王", "小李", "张伟", "李娜", "王芳", "刘洋", "陈静", "赵磊"],
}

# User requests with every argument present, keyed by tool, then language.
_REQUESTS: dict[str, dict[str, list[str]]] = {
    "query_status": {
        "en": [
            "What is the status of item {item_id}?",
            "Check the status of {item_id}.",
            "Can you look up item {item_id} for me?",
        ],
        "zh": ["查询条目 {item_id} 的状态。", "{item_id} 现在是什么状态？", "帮我看看 {item_id} 的进度。"],
    },
    "delete_item": {
        "en": ["Delete item {item_id}. Reason: {reason}.", "Please remove {item_id} ({reason})."],
        "zh": ["删除条目 {item_id}，原因：{reason}。", "请删掉 {item_id}（{reason}）。"],
    },
    "cancel_order": {
        "en": ["Cancel order {order_id}.", "Please cancel my order {order_id}."],
        "zh": ["取消订单 {order_id}。", "帮我把订单 {order_id} 取消掉。"],
    },
    "update_priority": {
        "en": ["Set the priority of {item_id} to {priority}.", "Change {item_id} to {priority} priority."],
        "zh": ["把 {item_id} 的优先级设为 {priority}。", "{item_id} 的优先级改成 {priority}。"],
    },
    "create_ticket": {
        "en": ['Create a ticket titled "{title}".', "Open a ticket: {title}"],
        "zh": ["创建工单，标题：{title}。", "帮我开个工单：{title}"],
    },
}
# User requests missing exactly one required argument, keyed by (tool, missing argument).
_MISSING: dict[tuple[str, str], dict[str, list[str]]] = {
    ("query_status", "item_id"): {
        "en": ["What is the status of my item?", "Can you check an item's status?"],
        "zh": ["帮我查一下状态。", "我想查询一个条目的状态。"],
    },
    ("delete_item", "item_id"): {
        "en": ["Delete an item. Reason: {reason}."],
        "zh": ["删除一个条目，原因：{reason}。"],
    },
    ("delete_item", "reason"): {
        "en": ["Delete item {item_id}.", "Please remove {item_id}."],
        "zh": ["删除条目 {item_id}。", "帮我删掉 {item_id}。"],
    },
    ("cancel_order", "order_id"): {
        "en": ["Cancel my order.", "I want to cancel an order."],
        "zh": ["帮我取消订单。", "我要取消一个订单。"],
    },
    ("update_priority", "item_id"): {
        "en": ["Set the priority to {priority}."],
        "zh": ["把优先级改成 {priority}。"],
    },
    ("update_priority", "priority"): {
        "en": ["Change the priority of {item_id}."],
        "zh": ["修改 {item_id} 的优先级。"],
    },
    ("create_ticket", "title"): {
        "en": ["Create a ticket for me.", "I need to open a ticket."],
        "zh": ["帮我建一个工单。", "我要提交工单。"],
    },
}
_SUPPLY = {
    "en": ["{value}", "It's {value}.", "The {arg} is {value}."],
    "zh": ["{value}", "是 {value}。", "{arg} 是 {value}。"],
}
_YES = {"en": ["Yes.", "Yes, go ahead.", "Sure, do it."], "zh": ["是", "是的，继续。", "好的，执行吧。"]}
_NO = {"en": ["No.", "No, don't do it.", "Never mind."], "zh": ["不", "不用了。", "算了，先不要。"]}
_GREET = {"en": "Hello! How can I help you today?", "zh": "你好！有什么可以帮你的？"}
_GREET_NAMED = {"en": "Hello {name}! How can I help you today?", "zh": "你好，{name}！有什么可以帮你的？"}
_CAPS = {
    "en": "I can check item status, update priority, create tickets, delete items and cancel orders.",
    "zh": "我可以查询状态、修改优先级、创建工单、删除条目和取消订单。",
}
_THANKS = {"en": "You're welcome!", "zh": "不客气！"}
# (user template, reply template) for chat that needs no tool; {name} fills both sides.
_CHAT = {
    "en": [
        ("Hi!", _GREET["en"]),
        ("Good morning.", _GREET["en"]),
        ("Hi, I'm {name}.", _GREET_NAMED["en"]),
        ("Hello, my name is {name}.", _GREET_NAMED["en"]),
        ("What can you do?", _CAPS["en"]),
        ("Which tools do you have?", _CAPS["en"]),
        ("Thanks for the help!", _THANKS["en"]),
    ],
    "zh": [
        ("你好！", _GREET["zh"]),
        ("早上好。", _GREET["zh"]),
        ("你好，我是{name}。", _GREET_NAMED["zh"]),
        ("我叫{name}。", _GREET_NAMED["zh"]),
        ("你能做什么？", _CAPS["zh"]),
        ("你有哪些工具？", _CAPS["zh"]),
        ("谢谢！", _THANKS["zh"]),
    ],
}

# Assistant reply templates: these are the conventions the evaluator reads decisions from.
CLARIFY_REPLY = {"en": "Could you provide the {arg}?", "zh": "请提供 {arg}。"}
CONFIRM_REPLY = {
    "delete_item": {
        "en": "Please confirm: delete item {item_id} (reason: {reason})? Reply yes to proceed.",
        "zh": "请确认：删除条目 {item_id}（原因：{reason}）？回复“是”继续。",
    },
    "cancel_order": {
        "en": "Please confirm: cancel order {order_id}? Reply yes to proceed.",
        "zh": "请确认：取消订单 {order_id}？回复“是”继续。",
    },
}
DECLINE_REPLY = {"en": "Okay, I will not do it.", "zh": "好的，不执行该操作。"}
SUMMARY_REPLY = {
    "query_status": {"en": "Item {item_id} is {status}.", "zh": "{item_id} 的状态是 {status}。"},
    "delete_item": {"en": "Item {item_id} has been deleted.", "zh": "已删除条目 {item_id}。"},
    "cancel_order": {"en": "Order {order_id} has been cancelled.", "zh": "订单 {order_id} 已取消。"},
    "update_priority": {
        "en": "Done: {item_id} now has {priority} priority.",
        "zh": "已将 {item_id} 的优先级设为 {priority}。",
    },
    "create_ticket": {
        "en": "Created ticket {ticket_id}: {title}.",
        "zh": "已创建工单 {ticket_id}：{title}。",
    },
}


@dataclass(frozen=True)
class Sample:
    """One JSONL record plus the OpenAI assistant message that correctly answers it."""

    record: dict[str, Any]
    reference_message: dict[str, Any]


def _text(content: str) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def _call(name: str, args: dict[str, str]) -> dict[str, Any]:
    fn = {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}
    call = {"id": "call_0", "type": "function", "function": fn}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


_REQUIRED = {t["function"]["name"]: tuple(t["function"]["parameters"]["required"]) for t in TOOLS}
_VALUES: dict[str, Callable[[random.Random, Lang], str]] = {
    "item_id": lambda rng, lang: f"{rng.choice('ABCK')}-{rng.randint(1000, 9999)}",
    "order_id": lambda rng, lang: f"ORD-{rng.randint(10000, 99999)}",
    "reason": lambda rng, lang: rng.choice(_REASONS[lang]),
    "priority": lambda rng, lang: rng.choice(("low", "medium", "high")),
    "title": lambda rng, lang: rng.choice(_TITLES[lang]),
}


def arguments_for(rng: random.Random, tool: str, lang: Lang) -> dict[str, str]:
    return {arg: _VALUES[arg](rng, lang) for arg in _REQUIRED[tool]}


def opening(
    rng: random.Random, lang: Lang, tool: str, args: dict[str, str], missing: str | None
) -> list[dict]:
    """Opening user turn, and if an argument is missing the clarify exchange that recovers it."""
    if missing is None:
        return [{"role": "user", "content": rng.choice(_REQUESTS[tool][lang]).format(**args)}]
    return [
        {"role": "user", "content": rng.choice(_MISSING[(tool, missing)][lang]).format(**args)},
        _text(CLARIFY_REPLY[lang].format(arg=missing)),
        {"role": "user", "content": rng.choice(_SUPPLY[lang]).format(arg=missing, value=args[missing])},
    ]


def _confirmed(rng: random.Random, lang: Lang, tool: str, args: dict[str, str]) -> list[dict]:
    yes = {"role": "user", "content": rng.choice(_YES[lang])}
    return [_text(CONFIRM_REPLY[tool][lang].format(**args)), yes]


def _conversation(rng: random.Random, category: str, lang: Lang) -> tuple[list[dict], dict[str, Any]]:
    """(messages after the system prompt, reference reply) for one conversation ending in `category`."""
    r = rng.random()  # picks the shape; the thresholds put about 40% of all samples in multi-turn shapes
    if category == "clarify":
        tool, missing = rng.choice(list(_MISSING))
        args = arguments_for(rng, tool, lang)
        user = rng.choice(_MISSING[(tool, missing)][lang]).format(**args)
        return [{"role": "user", "content": user}], _text(CLARIFY_REPLY[lang].format(arg=missing))
    if category == "tool_call":
        # Safe tools straight away or after a clarify exchange; destructive ones only after a yes.
        tool = rng.choice(_SAFE) if r < 0.68 else rng.choice(_RISKY)
        args = arguments_for(rng, tool, lang)
        if tool in DESTRUCTIVE:
            return opening(rng, lang, tool, args, None) + _confirmed(rng, lang, tool, args), _call(tool, args)
        missing = rng.choice(list(args)) if r < 0.08 else None
        return opening(rng, lang, tool, args, missing), _call(tool, args)
    if category == "confirm":
        tool = rng.choice(_RISKY)
        args = arguments_for(rng, tool, lang)
        missing = rng.choice(list(args)) if r < 0.25 else None
        return opening(rng, lang, tool, args, missing), _text(CONFIRM_REPLY[tool][lang].format(**args))
    if r < 0.2:
        user, reply = rng.choice(_CHAT[lang])
        name = rng.choice(_NAMES[lang])
        return [{"role": "user", "content": user.format(name=name)}], _text(reply.format(name=name))
    if r < 0.55:  # the user declines a destructive action
        tool = rng.choice(_RISKY)
        args = arguments_for(rng, tool, lang)
        history = opening(rng, lang, tool, args, None)
        no = {"role": "user", "content": rng.choice(_NO[lang])}
        history += [_text(CONFIRM_REPLY[tool][lang].format(**args)), no]
        return history, _text(DECLINE_REPLY[lang])
    # A tool already ran: summarise its result (destructive ones ran after a yes).
    tool = rng.choice(_ALL)
    args = arguments_for(rng, tool, lang)
    history = opening(rng, lang, tool, args, None)
    if tool in DESTRUCTIVE:
        history += _confirmed(rng, lang, tool, args)
    result: dict[str, Any] = {"ok": True}
    if tool == "query_status":
        result = {"item_id": args["item_id"], "status": rng.choice(STATUSES)}
    elif tool == "create_ticket":
        result = {"ticket_id": f"T-{rng.randint(100, 999)}"}
    history += [_call(tool, args), _tool_message(result)]
    return history, _text(SUMMARY_REPLY[tool][lang].format(**{**args, **result}))


# Tools whose item may have moved in the self-correction variant (they take an `item_id`, need no confirm).
MOVABLE_TOOLS: tuple[str, ...] = ("query_status", "update_priority")


def moved_error(item_id: str, new_id: str) -> dict[str, str]:
    """The tool result of a call on an item that moved: an error naming where it went."""
    return {"error": f"item {item_id} was moved", "moved_to": new_id}


def tool_result(tool: str, args: dict[str, str], status: str) -> dict[str, Any]:
    """A successful result of a movable tool (what the summary reply reads from)."""
    return {"item_id": args["item_id"], "status": status} if tool == "query_status" else {"ok": True}


def new_item_id(rng: random.Random, lang: Lang, old: str) -> str:
    while (new := _VALUES["item_id"](rng, lang)) == old:
        pass
    return new


def _retry(rng: random.Random, lang: Lang) -> tuple[list[dict], dict[str, Any]]:
    """A call whose item moved, then the same call on the new id; or, after that succeeded, its summary."""
    tool = rng.choice(MOVABLE_TOOLS)
    args = arguments_for(rng, tool, lang)
    moved = {**args, "item_id": new_item_id(rng, lang, args["item_id"])}
    error = _tool_message(moved_error(args["item_id"], moved["item_id"]))
    history = [*opening(rng, lang, tool, args, None), _call(tool, args), error]
    if rng.random() < 0.5:
        return history, _call(tool, moved)
    result = tool_result(tool, moved, rng.choice(STATUSES))
    history += [_call(tool, moved), _tool_message(result)]
    return history, _text(SUMMARY_REPLY[tool][lang].format(**{**moved, **result}))


def _tool_message(content: dict[str, Any]) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": "call_0", "content": json.dumps(content, ensure_ascii=False)}


def solution_of(message: dict[str, Any], category: str) -> str:
    """The `solution` JSON string for a reference assistant message."""
    calls = [
        {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
        for c in message.get("tool_calls") or []
    ]
    return json.dumps({"decision": category, "tool_calls": calls}, ensure_ascii=False, sort_keys=True)


def decision_of(message: dict[str, Any], category: str) -> str:
    """The decision a reference reply takes: its category's, except for `retry` (a call or a summary)."""
    if category != "retry":
        return category
    return "tool_call" if message.get("tool_calls") else "no_tool"


def canonical(messages: list[dict[str, Any]]) -> str:
    return json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def _bucket(canonical: str) -> Split:
    return "validation" if int(hashlib.sha256(canonical.encode()).hexdigest()[:8], 16) % 5 == 0 else "train"


def split_of(messages: list[dict[str, Any]]) -> Split:
    """Stable split of a conversation from a hash of its messages: splits are disjoint by construction."""
    return _bucket(canonical(messages))


def make_samples(
    split: Split, n: int, seed: int = 0, categories: tuple[str, ...] = CATEGORIES
) -> list[Sample]:
    """`n` distinct samples of `split`, deterministic in (split, n, seed, categories); categories cycle
    evenly (`SELF_CORRECTION_CATEGORIES` adds the `retry` shape)."""
    rng = random.Random(f"tool_routing:{split}:{seed}")
    samples: list[Sample] = []
    seen: set[str] = set()
    for _ in range(100 * n + 1000):  # bounded: the chat-only corner of the space is small
        if len(samples) == n:
            return samples
        category = categories[len(samples) % len(categories)]
        lang: Lang = rng.choice(("en", "zh"))
        if category == "retry":
            history, reference = _retry(rng, lang)
        else:
            history, reference = _conversation(rng, category, lang)
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, *history]
        key = canonical(messages)
        if key in seen or _bucket(key) != split:
            continue
        seen.add(key)
        extra = {
            "sample_id": f"{split}-{len(samples):06d}",
            "category": category,
            "solution": solution_of(reference, decision_of(reference, category)),
        }
        samples.append(Sample({"messages": messages, "tools": TOOLS, "rollout_extra": extra}, reference))
    raise ValueError(f"could not generate {n} distinct {split} samples")
