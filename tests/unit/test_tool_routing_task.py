"""Unit tests for the synthetic tool-routing task generator."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path

import pytest

from opd_trainer.demo.tool_routing import CATEGORIES, TOOL_NAMES, TOOLS, make_samples
from opd_trainer.demo.tool_routing.evaluator import format_reply, parse_reply, score_reply
from opd_trainer.demo.tool_routing.task import DESTRUCTIVE, SYSTEM_PROMPT, Sample, split_of
from opd_trainer.jsonl import read_jsonl, write_jsonl

_CJK = re.compile(r"[\u4e00-\u9fff]")


def _lang(sample: Sample) -> str:
    return "zh" if _CJK.search(sample.record["messages"][1]["content"]) else "en"


def _prompt_key(sample: Sample) -> str:
    return json.dumps(sample.record["messages"], ensure_ascii=False, sort_keys=True)


@pytest.fixture(scope="module")
def train() -> list[Sample]:
    return make_samples("train", 3000)


@pytest.fixture(scope="module")
def validation() -> list[Sample]:
    return make_samples("validation", 1000)


def test_same_seed_is_identical() -> None:
    assert make_samples("train", 200, seed=3) == make_samples("train", 200, seed=3)


def test_different_seeds_differ() -> None:
    a = {_prompt_key(s) for s in make_samples("train", 200, seed=0)}
    b = {_prompt_key(s) for s in make_samples("train", 200, seed=1)}
    assert len(a & b) < 50  # only the small greeting space may repeat


def test_prefix_is_stable_in_n() -> None:
    assert make_samples("validation", 50) == make_samples("validation", 120)[:50]


def test_splits_are_disjoint_and_deduplicated(train: list[Sample], validation: list[Sample]) -> None:
    train_keys = {_prompt_key(s) for s in train}
    val_keys = {_prompt_key(s) for s in validation}
    assert len(train_keys) == len(train) and len(val_keys) == len(validation)
    assert not train_keys & val_keys
    assert all(split_of(s.record["messages"]) == "train" for s in train)
    assert all(split_of(s.record["messages"]) == "validation" for s in validation)


def test_sample_ids(train: list[Sample], validation: list[Sample]) -> None:
    assert train[0].record["rollout_extra"]["sample_id"] == "train-000000"
    assert validation[12].record["rollout_extra"]["sample_id"] == "validation-000012"
    assert len({s.record["rollout_extra"]["sample_id"] for s in train}) == len(train)


def test_categories_languages_and_turns_are_mixed(train: list[Sample]) -> None:
    by_category = Counter(s.record["rollout_extra"]["category"] for s in train)
    assert set(by_category) == set(CATEGORIES)
    assert max(by_category.values()) - min(by_category.values()) <= 1
    by_pair = Counter((s.record["rollout_extra"]["category"], _lang(s)) for s in train)
    assert all(by_pair[(c, lang)] > 0.35 * len(train) / 4 for c in CATEGORIES for lang in ("en", "zh"))
    multi = sum(len(s.record["messages"]) > 2 for s in train) / len(train)
    assert 0.3 < multi < 0.5
    roles = Counter(m["role"] for s in train for m in s.record["messages"])
    assert roles["tool"] > 0 and roles["assistant"] > 0


def test_record_shape(train: list[Sample]) -> None:
    names = [t["function"]["name"] for t in TOOLS]
    assert names == ["query_status", "delete_item", "cancel_order", "update_priority", "create_ticket"]
    for sample in train[:200]:
        record = sample.record
        assert set(record) == {"messages", "tools", "rollout_extra"}
        assert record["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT}
        assert record["messages"][1]["role"] == "user" and record["messages"][-1]["role"] in ("user", "tool")
        assert record["tools"] == TOOLS
        solution = json.loads(record["rollout_extra"]["solution"])
        assert set(solution) == {"decision", "tool_calls"}
        assert solution["decision"] == record["rollout_extra"]["category"]
        assert (solution["decision"] == "tool_call") == bool(solution["tool_calls"])
        for call in solution["tool_calls"]:
            assert set(call) == {"name", "arguments"} and call["name"] in TOOL_NAMES


def test_arguments_are_copied_from_the_conversation(train: list[Sample]) -> None:
    for sample in train:
        solution = json.loads(sample.record["rollout_extra"]["solution"])
        said = " ".join(m["content"] for m in sample.record["messages"][1:] if m["role"] == "user")
        for call in solution["tool_calls"]:
            assert all(value in said for value in call["arguments"].values()), sample.record


def test_destructive_calls_only_after_a_confirmation(train: list[Sample]) -> None:
    for sample in train:
        calls = [
            c["function"]["name"]
            for m in [*sample.record["messages"], sample.reference_message]
            for c in m.get("tool_calls") or []
        ]
        if any(name in DESTRUCTIVE for name in calls):
            assistant_texts = [m["content"] for m in sample.record["messages"] if m["role"] == "assistant"]
            assert any("confirm" in t.lower() or "确认" in t for t in assistant_texts), sample.record


def test_reply_language_follows_the_user(train: list[Sample]) -> None:
    for sample in train:
        reply = sample.reference_message["content"]
        if reply and _lang(sample) == "zh":
            assert _CJK.search(reply), sample.record
        elif reply:
            assert not _CJK.search(reply), sample.record


def test_reference_replies_score_exact_match(train: list[Sample], validation: list[Sample]) -> None:
    for sample in train + validation:
        text = format_reply(sample.reference_message)
        score = score_reply(parse_reply(text), sample.record["rollout_extra"]["solution"])
        assert score.exact_match, (text, sample.record["rollout_extra"])
    # History turns follow the same conventions, so they classify as what they are.
    for sample in train:
        for message in sample.record["messages"]:
            if message["role"] == "assistant" and not message.get("tool_calls"):
                assert parse_reply(message["content"]).decision in ("clarify", "confirm")


def test_tool_call_messages_use_openai_format(train: list[Sample]) -> None:
    sample = next(s for s in train if s.record["rollout_extra"]["category"] == "tool_call")
    message = sample.reference_message
    assert message["role"] == "assistant" and message["content"] == ""
    (call,) = message["tool_calls"]
    assert call["id"] == "call_0" and call["type"] == "function"
    assert isinstance(json.loads(call["function"]["arguments"]), dict)


def test_jsonl_round_trip(tmp_path: Path, train: list[Sample]) -> None:
    records = [s.record for s in train[:300]]
    path = tmp_path / "train.jsonl"
    write_jsonl(path, records)
    assert read_jsonl(path) == records
    assert "条目" in path.read_text(encoding="utf-8") or "工单" in path.read_text(encoding="utf-8")


def test_conversations_are_short(train: list[Sample]) -> None:
    for sample in train:
        variable = json.dumps([*sample.record["messages"][1:], sample.reference_message], ensure_ascii=False)
        assert len(variable) < 1000


def test_generation_is_fast() -> None:
    start = time.perf_counter()
    make_samples("train", 5000, seed=7)
    assert time.perf_counter() - start < 2.0
