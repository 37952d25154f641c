"""Dataset validation with line numbers, and the resumable epoch cursor."""

from __future__ import annotations

import json

import pytest

from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.dataset import EpochCursor, parse_jsonl, record_problem

GOOD = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("record", "fragment"),
    [
        ([], "JSON object"),
        ({"messages": []}, "messages: must be a non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content: missing"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}]},
            "system message",
        ),
        ({"messages": [{"role": "assistant", "content": "a"}]}, "first non-system"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "must end"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]}, "tool message"),
        ({**GOOD, "tools": "x"}, "tools"),
        ({**GOOD, "rollout_extra": []}, "rollout_extra"),
        ({**GOOD, "extra": 1}, "unknown field"),
    ],
)
def test_record_problems_name_the_field(record: object, fragment: str) -> None:
    problem = record_problem(record)
    assert problem is not None and fragment in problem


def test_good_record_passes() -> None:
    tool_turn = {
        "messages": [
            {"role": "user", "content": "status of A-1"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "q", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c", "content": "ok"},
        ],
        "rollout_extra": {"solution": "{}"},
    }
    assert record_problem(GOOD) is None
    assert record_problem(tool_turn) is None


@pytest.mark.parametrize("solution", ["42", 42, {"answer": 7}, ["a", "b"], None, "not json {", 1.5])
def test_rollout_extra_is_the_users_any_json(solution: object) -> None:
    """The trainer never assumes the demo's `solution` shape; processors read it as they like."""
    record = {**GOOD, "rollout_extra": {"solution": solution, "ground_truth": solution}}
    assert record_problem(record) is None
    [sample] = parse_jsonl(json.dumps(record), "/data/x.jsonl")
    assert sample.rollout_extra["solution"] == solution


def test_bad_lines_reported_with_numbers() -> None:
    text = "\n".join([json.dumps(GOOD), json.dumps(GOOD), "{not json", json.dumps({"messages": []}), ""])
    with pytest.raises(ConfigError) as raised:
        parse_jsonl(text, "/data/train.jsonl")
    message = str(raised.value)
    assert "train.jsonl" in message and "line 3" in message and "line 4" in message
    assert "line 1" not in message


def test_parse_keeps_line_numbers_and_ids() -> None:
    text = "\n" + json.dumps({**GOOD, "rollout_extra": {"sample_id": "x-1"}}) + "\n" + json.dumps(GOOD)
    samples = parse_jsonl(text, "d.jsonl")
    assert [s.line for s in samples] == [2, 3]
    assert samples[0].sample_id == "x-1" and samples[1].sample_id == "d.jsonl:3"


def test_cursor_covers_each_epoch_once_and_resumes_identically() -> None:
    cursor = EpochCursor(num_samples=10, seed=3)
    first_epoch = cursor.next_batch(4) + cursor.next_batch(4)
    crossing = cursor.next_batch(4)  # 2 from epoch 0, 2 from epoch 1
    assert sorted(first_epoch + crossing[:2]) == list(range(10))
    assert cursor.epoch == 1
    saved = json.loads(json.dumps(cursor.state()))
    expected = [cursor.next_batch(3) for _ in range(5)]
    resumed = EpochCursor(num_samples=10, seed=3)
    resumed.restore(saved)
    assert [resumed.next_batch(3) for _ in range(5)] == expected
    assert EpochCursor(10, seed=4).next_batch(10) != EpochCursor(10, seed=3).next_batch(10)
