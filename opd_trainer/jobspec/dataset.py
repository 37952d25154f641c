"""Training/validation JSONL: line-by-line validation with line numbers, and a seeded epoch cursor.

One record: `{"messages": [...], "tools": [...]?, "rollout_extra": {...}?}` where `messages` is an
OpenAI chat history ending where the model answers next (a user or tool message). `rollout_extra` is
the user's: any JSON object, handed to their processors as it is (`solution` / `ground_truth` may be
any JSON value); only `sample_id`, if present, is read here.

A record without `messages` is a *task record* (Hugging Face datasets' shape, e.g.
`{"question": "What is 2 + 2?", "answer": "4"}`): any non-empty JSON object, kept whole as the sample's
`rollout_extra.task` for a workflow function to turn into a conversation (`opd_trainer/sdk/workflow.py`);
its reference answer is its `ground_truth`, else `answer`, else `solution`. Such samples have no
messages, so a job on them needs a rollout component (`TASK_RECORDS_NEED_A_ROLLOUT`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opd_trainer.errors import ConfigError

ROLES = {"system", "user", "assistant", "tool"}
TASK_KEY = "task"  # rollout_extra key of a task record (read by sdk/workflow.py, tuner.py, opd preview)
TASK_RECORDS_NEED_A_ROLLOUT = (
    "holds task records (no `messages`): give the job a rollout component, e.g. a workflow function, "
    "to turn each task into a conversation"
)
MAX_REPORTED_PROBLEMS = 20


@dataclass(frozen=True)
class Sample:
    """One prompt: where it came from, its history, tools and free-form extras."""

    source: str
    line: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    rollout_extra: dict[str, Any] = field(default_factory=dict)

    @property
    def sample_id(self) -> str:
        return str(self.rollout_extra.get("sample_id", f"{Path(self.source).name}:{self.line}"))


DATA_TAG_KEY = "data_tag"
"""`rollout_extra.data_tag`: what routes a record to one of several teachers (`data_tag_of`)."""


def data_tag_of(sample: Sample) -> str:
    """The sample's data tag: `rollout_extra.data_tag` when it is a string, else the name of the
    dataset file it came from without its extension (`math` for math.jsonl)."""
    tag = sample.rollout_extra.get(DATA_TAG_KEY)
    return tag if isinstance(tag, str) and tag else Path(sample.source).stem


def ground_truth_of(sample: Sample) -> Any:
    """The sample's reference answer as stored (`rollout_extra.ground_truth`, else `.solution`): Bailian
    rewards `json.loads` a string, use a dict as is."""
    extra = sample.rollout_extra
    task = extra.get(TASK_KEY)
    if not sample.messages and isinstance(task, dict):
        return task.get("ground_truth", task.get("answer", task.get("solution")))
    return extra.get("ground_truth", extra.get("solution"))


def sample_view(sample: Sample) -> dict[str, Any]:
    """How the trainer reads one sample, as JSON: what `opd preview` shows and processors receive."""
    return {
        "sample_id": sample.sample_id,
        "source": f"{Path(sample.source).name}:{sample.line}",
        "messages": sample.messages,
        "tools": [tool["function"].get("name") for tool in sample.tools or []],
        "ground_truth": ground_truth_of(sample),
        "rollout_extra": sample.rollout_extra,
    }


def record_problem(record: Any) -> str | None:
    """Why a decoded record is not a valid sample, or None. Messages name the offending field."""
    if not isinstance(record, dict):
        return "a record must be a JSON object"
    if "messages" not in record:
        return None if record else "a record must not be empty"
    unknown = set(record) - {"messages", "tools", "rollout_extra"}
    if unknown:
        return f"unknown field(s) {sorted(unknown)}"
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages: must be a non-empty list"
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            return f"{where}: must be an object"
        role = message.get("role")
        if role not in ROLES:
            return f"{where}.role: must be one of {sorted(ROLES)}, got {role!r}"
        content = message.get("content")
        if role == "system" and index != 0:
            return f"{where}.role: a system message may only come first"
        if role == "tool" and (index == 0 or messages[index - 1].get("role") not in {"assistant", "tool"}):
            return f"{where}.role: a tool message must follow an assistant message with tool_calls"
        if content is not None and not isinstance(content, str | list):
            return f"{where}.content: must be a string"
        if content is None and not (role == "assistant" and message.get("tool_calls")):
            return f"{where}.content: missing"
    conversation = [m for m in messages if m["role"] != "system"]
    if not conversation or conversation[0]["role"] != "user":
        return "messages: the first non-system message must be from the user"
    if messages[-1]["role"] not in {"user", "tool"}:
        return "messages: must end with a user or tool message (the model answers next)"
    tools = record.get("tools")
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) and "function" in t for t in tools)
    ):
        return "tools: must be a list of OpenAI function definitions"
    extra = record.get("rollout_extra", {})
    if not isinstance(extra, dict):
        return "rollout_extra: must be an object"
    return None


def parse_jsonl(text: str, source: str) -> list[Sample]:
    """All samples of one JSONL text, or a `ConfigError` listing every bad line (first 20)."""
    samples: list[Sample] = []
    problems: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"line {number}: not valid JSON ({exc.msg})")
            continue
        problem = record_problem(record)
        if problem:
            problems.append(f"line {number}: {problem}")
            continue
        if "messages" not in record:  # a task record, kept whole
            samples.append(Sample(source, number, [], None, {TASK_KEY: record}))
            continue
        samples.append(
            Sample(source, number, record["messages"], record.get("tools"), record.get("rollout_extra", {}))
        )
    if problems:
        shown = "; ".join(problems[:MAX_REPORTED_PROBLEMS])
        more = (
            f" (and {len(problems) - MAX_REPORTED_PROBLEMS} more)"
            if len(problems) > MAX_REPORTED_PROBLEMS
            else ""
        )
        raise ConfigError(f"{Path(source).name}: {shown}{more}", field="dataset")
    if not samples:
        raise ConfigError(f"{Path(source).name}: no records", field="dataset")
    return samples


def load_samples(paths: list[str], field_name: str) -> list[Sample]:
    """Reads and validates every file; `field_name` is the job field the paths came from."""
    samples: list[Sample] = []
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror}", field=field_name) from None
        try:
            samples.extend(parse_jsonl(text, path))
        except ConfigError as exc:
            raise ConfigError(exc.message, field=field_name) from None
    return samples


@dataclass
class EpochCursor:
    """Where the job is in its data: epoch, position in that epoch's seeded shuffle.

    Plain ints only, so it round-trips through the checkpoint's JSON and a resumed job continues
    with exactly the prompts an uninterrupted one would have seen.
    """

    num_samples: int
    seed: int
    epoch: int = 0
    position: int = 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.num_samples))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, batch_size: int) -> list[int]:
        """The next `batch_size` sample indices, crossing into the next epoch when one ends."""
        batch: list[int] = []
        while len(batch) < batch_size:
            order = self._order(self.epoch)
            take = order[self.position : self.position + batch_size - len(batch)]
            batch.extend(take)
            self.position += len(take)
            if self.position >= self.num_samples:
                self.epoch += 1
                self.position = 0
        return batch

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def restore(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
