"""Unit tests for the tool-routing evaluator on hand-written replies."""

from __future__ import annotations

import json

import pytest

from opd_trainer.demo.tool_routing import (
    ReplyScore,
    aggregate,
    evaluate_texts,
    format_reply,
    message_to_parsed,
    parse_reply,
    score_reply,
)


def _block(payload: str) -> str:
    return f"<tool_call>\n{payload}\n</tool_call>"


def _solution(decision: str, *calls: tuple[str, dict[str, str]]) -> str:
    tool_calls = [{"name": name, "arguments": args} for name, args in calls]
    return json.dumps({"decision": decision, "tool_calls": tool_calls}, ensure_ascii=False, sort_keys=True)


DELETE = _solution("tool_call", ("delete_item", {"item_id": "A-4821", "reason": "duplicate"}))
TWO = _solution("tool_call", ("query_status", {"item_id": "A-1"}), ("create_ticket", {"title": "退款"}))


def _score(text: str, solution: str) -> ReplyScore:
    return score_reply(parse_reply(text), solution)


def test_correct_tool_call() -> None:
    text = _block('{"name": "delete_item", "arguments": {"item_id": "A-4821", "reason": "duplicate"}}')
    parsed = parse_reply(text)
    assert parsed.decision == "tool_call" and parsed.format_valid
    assert parsed.tool_calls[0].name == "delete_item"
    assert _score(text, DELETE) == ReplyScore(True, True, True, True, True)


def test_argument_key_order_does_not_matter() -> None:
    text = _block('{"arguments": {"reason": "duplicate", "item_id": "A-4821"}, "name": "delete_item"}')
    assert _score(text, DELETE).exact_match


def test_wrong_tool_name() -> None:
    text = _block('{"name": "cancel_order", "arguments": {"item_id": "A-4821", "reason": "duplicate"}}')
    assert _score(text, DELETE) == ReplyScore(True, True, False, False, False)


def test_right_name_wrong_arguments() -> None:
    text = _block('{"name": "delete_item", "arguments": {"item_id": "A-4812", "reason": "duplicate"}}')
    assert _score(text, DELETE) == ReplyScore(True, True, True, False, False)
    missing = _block('{"name": "delete_item", "arguments": {"item_id": "A-4821"}}')
    assert _score(missing, DELETE) == ReplyScore(True, True, True, False, False)


def test_two_calls_in_either_order() -> None:
    a = _block('{"name": "query_status", "arguments": {"item_id": "A-1"}}')
    b = _block('{"name": "create_ticket", "arguments": {"title": "退款"}}')
    assert _score(f"{a}\n{b}", TWO).exact_match
    assert _score(f"{b}\n{a}", TWO).exact_match
    assert _score(a, TWO) == ReplyScore(True, True, False, False, False)
    assert _score(f"{a}\n{a}\n{b}", TWO) == ReplyScore(True, True, False, False, False)


def test_malformed_json_block() -> None:
    text = _block('{"name": "delete_item", "arguments": {"item_id": "A-4821", "reason": "duplicate"}')
    parsed = parse_reply(text)
    assert parsed.decision == "tool_call" and not parsed.format_valid and parsed.tool_calls == ()
    assert _score(text, DELETE) == ReplyScore(False, True, False, False, False)


@pytest.mark.parametrize(
    "payload",
    [
        '{"name": "drop_table", "arguments": {"item_id": "A-4821"}}',  # unknown tool
        '{"name": "delete_item", "arguments": "{\\"item_id\\": \\"A-4821\\"}"}',  # arguments not a dict
        '{"name": 7, "arguments": {}}',
        '["delete_item"]',
        "",
    ],
)
def test_invalid_blocks(payload: str) -> None:
    assert not parse_reply(_block(payload)).format_valid


def test_unknown_tool_is_kept_but_invalid() -> None:
    parsed = parse_reply(_block('{"name": "drop_table", "arguments": {"item_id": "A-4821"}}'))
    assert [c.name for c in parsed.tool_calls] == ["drop_table"] and not parsed.format_valid


def test_unclosed_tag() -> None:
    text = '<tool_call>\n{"name": "delete_item", "arguments": {"item_id": "A-4821", "reason": "duplicate"}}'
    parsed = parse_reply(text)
    assert parsed.decision == "tool_call" and not parsed.format_valid and parsed.tool_calls == ()
    assert not _score(text, DELETE).exact_match
    good = _block('{"name": "delete_item", "arguments": {"item_id": "A-4821", "reason": "duplicate"}}')
    assert not parse_reply(good + "\n</tool_call>").format_valid
    assert not parse_reply(good + "\n<tool_call>").format_valid


def test_text_around_a_block_is_allowed() -> None:
    text = "Let me delete it.\n" + _block(
        '{"name": "delete_item", "arguments": {"item_id": "A-4821", "reason": "duplicate"}}'
    )
    parsed = parse_reply(text)
    assert parsed.text == "Let me delete it." and _score(text, DELETE).exact_match


@pytest.mark.parametrize(
    ("text", "decision"),
    [
        ("Could you provide the item_id?", "clarify"),
        ("请提供 order_id。", "clarify"),
        ("Please confirm: delete item A-4821 (reason: duplicate)? Reply yes to proceed.", "confirm"),
        ("请确认：取消订单 ORD-77310？回复“是”继续。", "confirm"),
        ("CONFIRM cancel order ORD-77310?", "confirm"),
        ("Please confirm: could you provide the reason?", "confirm"),  # confirm wins over clarify
        ("Hello! How can I help you today?", "no_tool"),
        ("已删除条目 A-4821。", "no_tool"),
        ("Okay, I will not do it.", "no_tool"),
    ],
)
def test_text_decisions(text: str, decision: str) -> None:
    parsed = parse_reply(text)
    assert parsed.decision == decision and parsed.format_valid and parsed.tool_calls == ()


def test_text_decision_scores() -> None:
    clarify = _solution("clarify")
    assert _score("请提供 item_id。", clarify) == ReplyScore(True, True, True, True, True)
    confirm = "Please confirm: cancel order ORD-1?"
    assert _score(confirm, clarify) == ReplyScore(True, False, True, False, False)
    call = _block('{"name": "query_status", "arguments": {"item_id": "A-1"}}')
    assert _score(call, clarify) == ReplyScore(True, False, False, False, False)
    assert _score("Could you provide the reason?", DELETE) == ReplyScore(True, False, False, False, False)


@pytest.mark.parametrize("text", ["", "   \n"])
def test_empty_text_is_invalid(text: str) -> None:
    parsed = parse_reply(text)
    assert parsed.decision == "no_tool" and not parsed.format_valid
    assert _score(text, _solution("no_tool")) == ReplyScore(False, True, True, True, False)


def test_structured_message() -> None:
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {
                    "name": "delete_item",
                    "arguments": '{"reason": "duplicate", "item_id": "A-4821"}',
                },
            }
        ],
    }
    parsed = message_to_parsed(message)
    assert parsed.decision == "tool_call" and parsed.format_valid
    assert score_reply(parsed, json.loads(DELETE)).exact_match
    assert parse_reply(format_reply(message)) == parsed

    bad_call = {"name": "delete_item", "arguments": "{item_id: A-4821"}
    broken = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_0", "type": "function", "function": bad_call}],
    }
    parsed = message_to_parsed(broken)
    assert parsed.decision == "tool_call" and not parsed.format_valid and parsed.tool_calls == ()

    assert message_to_parsed({"role": "assistant", "content": "请提供 reason。"}).decision == "clarify"
    raw = message_to_parsed({"role": "assistant", "content": _block('{"name": "x", "arguments": {}}')})
    assert raw.decision == "tool_call" and not raw.format_valid


def test_aggregate_hand_computed() -> None:
    scores = [
        ReplyScore(True, True, True, True, True),
        ReplyScore(True, True, True, False, False),
        ReplyScore(False, True, False, False, False),
        ReplyScore(True, False, False, False, False),
    ]
    assert aggregate(scores) == {
        "format_validity": 0.75,
        "decision_accuracy": 0.75,
        "tool_name_accuracy": 0.5,
        "argument_accuracy": 0.25,
        "exact_match": 0.25,
        "n": 4.0,
    }
    assert aggregate([]) == {
        "format_validity": 0.0,
        "decision_accuracy": 0.0,
        "tool_name_accuracy": 0.0,
        "argument_accuracy": 0.0,
        "exact_match": 0.0,
        "n": 0.0,
    }


def test_evaluate_texts() -> None:
    records = [{"rollout_extra": {"solution": DELETE}}, {"rollout_extra": {"solution": _solution("confirm")}}]
    texts = [
        _block('{"name": "delete_item", "arguments": {"item_id": "A-4821", "reason": "duplicate"}}'),
        "Could you provide the reason?",
    ]
    assert evaluate_texts(texts, records) == {
        "format_validity": 1.0,
        "decision_accuracy": 0.5,
        "tool_name_accuracy": 1.0,
        "argument_accuracy": 0.5,
        "exact_match": 0.5,
        "n": 2.0,
    }
    with pytest.raises(ValueError):
        evaluate_texts(texts[:1], records)
