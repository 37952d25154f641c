"""Agent-level validation metrics (`rollout/agent_eval.py`) from rollouts built by hand: turns, tool
results, reference calls, pass@k. The real gateway's `format_valid`: test_tool_call_parsing.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from opd_trainer.jobspec.dataset import Sample
from opd_trainer.records import LLMCall
from opd_trainer.rollout.agent_eval import (
    agent_metrics,
    pass_at_k,
    reference_tool_calls,
    success_by_threshold,
)
from opd_trainer.rollout.runner import RolloutResult

USER = {"role": "user", "content": "refund order 7"}


def _tool_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _turn(tool_calls: list[dict[str, Any]], finish: str, valid: bool = True) -> LLMCall:
    message: dict[str, Any] = {"role": "assistant", "content": "" if tool_calls else "done"}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return LLMCall([1], [2], [-1.0], finish_reason=finish, response_message=message, format_valid=valid)


def _rollout(
    index: int, turns: list[LLMCall], tool_messages: list[dict[str, Any]], reward: float, solution: Any = None
) -> RolloutResult:
    extra = {} if solution is None else {"solution": solution}
    sample = Sample("val.jsonl", index, [USER], None, extra)
    messages = [USER, *(t.response_message for t in turns), *tool_messages]
    return RolloutResult(index, index, f"r{index}", sample, calls=turns, messages=messages, reward=reward)


def test_turns_tools_and_cut_offs_of_a_validation_pass() -> None:
    refund = _tool_call("c1", "refund", {"order": 7})
    # 1: called refund, got a result, answered -> succeeded (reward 1); reference matches exactly.
    one = _rollout(
        1,
        [_turn([refund], "tool_calls"), _turn([], "stop")],
        [{"role": "tool", "tool_call_id": "c1", "content": '{"ok": true}'}],
        1.0,
        solution=json.dumps({"tool_calls": [{"name": "refund", "arguments": {"order": 7}}]}),
    )
    # 2: the tool failed (JSON error), it retried with the wrong order and was cut off there.
    retry = _tool_call("c3", "refund", {"order": 8})
    two = _rollout(
        2,
        [_turn([_tool_call("c2", "refund", {"order": 7})], "tool_calls"), _turn([retry], "tool_calls")],
        [{"role": "tool", "tool_call_id": "c2", "content": '{"error": true, "message": "timeout"}'}],
        0.0,
        solution={"tool_calls": [{"function": {"name": "refund", "arguments": '{"order": 7}'}}]},
    )
    # 3: one malformed reply (cut by max_tokens), no tools, no reference.
    three = _rollout(3, [_turn([], "length", valid=False)], [], 0.0)
    # 4: an agent whose answer is the call (it runs no tools): judged on format, never cut off.
    four = _rollout(4, [_turn([_tool_call("c4", "refund", {"order": 7})], "tool_calls")], [], 0.0)
    metrics = agent_metrics([one, two, three], success_by_threshold(1.0))
    # ... also when the sample's own history holds a tool message (not an answer to this model's calls).
    four.messages.insert(1, {"role": "tool", "tool_call_id": "history-1", "content": "Error: earlier"})
    alone = agent_metrics([four], success_by_threshold(1.0))
    assert alone["agent/turn_success"] == 1.0 and alone["agent/cut_off_share"] == 0.0
    assert metrics["agent/format_valid_turns"] == pytest.approx(4 / 5)
    # Successful turns: one's two; two's first failed (error), its second has no result; three's invalid.
    assert metrics["agent/turn_success"] == pytest.approx(2 / 5)
    assert metrics["agent/task_success"] == pytest.approx(1 / 3)
    assert metrics["agent/tool_calls_per_trajectory"] == pytest.approx((1 + 2 + 0) / 3)
    assert metrics["agent/cut_off_share"] == pytest.approx(1 / 3)
    # Two references: one made exactly its calls; two made refund twice (names differ in count too).
    assert metrics["agent/tool_call_accuracy"] == pytest.approx(1 / 2)
    assert metrics["agent/tool_name_accuracy"] == pytest.approx(1 / 2)


@pytest.mark.parametrize(
    "tool_message",
    [
        {"role": "tool", "tool_call_id": "c1", "content": "Error: ValueError('no such order')"},
        {"role": "tool", "tool_call_id": "c1", "content": "oops", "status": "error"},
        {"role": "tool", "tool_call_id": "c1", "content": '{"is_error": 1}'},
    ],
)
def test_tool_errors_in_the_shapes_agents_report_them(tool_message: dict[str, Any]) -> None:
    rollout = _rollout(1, [_turn([_tool_call("c1", "refund", {})], "tool_calls")], [tool_message], 0.0)
    assert agent_metrics([rollout], success_by_threshold(1.0))["agent/turn_success"] == 0.0


def test_success_uses_the_evaluator_when_there_is_one_and_pass_at_k_any_of_k() -> None:
    low_reward_high_eval = _rollout(1, [_turn([], "stop")], [], 0.0)
    low_reward_high_eval.eval_score = 0.9
    failed = _rollout(2, [], [], 5.0)
    failed.error = "agent crashed"
    succeeded = success_by_threshold(0.8)
    assert succeeded(low_reward_high_eval) is True and succeeded(failed) is None
    plain = _rollout(3, [_turn([], "stop")], [], 0.5)
    assert pass_at_k([[plain, low_reward_high_eval], [plain, failed]], succeeded) == 0.5
    assert reference_tool_calls(plain) is None
    assert agent_metrics([failed], succeeded)["agent/task_success"] == 0.0


def _error(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": "Error: order is locked"}


def _ok(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": '{"ok": true}'}


def test_loops_recovery_after_an_error_and_repairing_a_wrong_history() -> None:
    def refund(call_id: str, order: int = 7) -> dict[str, Any]:
        return _tool_call(call_id, "refund", {"order": order})

    done = _turn([], "stop")
    # The same failing call again (a loop); a different call after the error that succeeded; no error;
    # the same call twice, the first one answered fine (not a loop).
    looping = _rollout(
        1,
        [_turn([refund("a")], "tool_calls"), _turn([refund("b")], "tool_calls"), done],
        [_error("a"), _error("b")],
        0.0,
    )
    recovers = _rollout(
        2,
        [_turn([refund("c")], "tool_calls"), _turn([refund("d", 8)], "tool_calls"), done],
        [_error("c"), _ok("d")],
        1.0,
    )
    clean = _rollout(3, [_turn([refund("e")], "tool_calls"), done], [_ok("e")], 1.0)
    twice = _rollout(
        4,
        [_turn([refund("f")], "tool_calls"), _turn([refund("g")], "tool_calls"), done],
        [_ok("f"), _ok("g")],
        0.0,
    )
    no_tools = _rollout(5, [done], [], 1.0)  # an agent that runs no tools: outside the loop share
    metrics = agent_metrics([looping, recovers, clean, twice, no_tools], success_by_threshold(1.0))
    assert metrics["agent/repeated_failing_call_share"] == pytest.approx(1 / 4)
    assert metrics["agent/recovery_after_error"] == pytest.approx(1 / 2)
    assert "agent/self_correction_success" not in metrics
    # Samples whose given history holds a failed call: repaired, not repaired, and a rollout that failed.
    wrong = [USER, {"role": "assistant", "content": "", "tool_calls": [refund("h")]}, _error("h")]
    repaired = _rollout(6, [_turn([refund("i", 8)], "tool_calls"), done], [_ok("i")], 1.0)
    stuck = _rollout(7, [_turn([refund("j")], "tool_calls"), done], [_error("j")], 0.0)
    crashed = _rollout(8, [], [], 1.0)
    crashed.error = "agent crashed"
    for result in (repaired, stuck, crashed):
        result.sample = Sample("val.jsonl", result.index, wrong, None, {})
    history = agent_metrics([repaired, stuck, crashed, clean], success_by_threshold(1.0))
    assert history["agent/self_correction_success"] == pytest.approx(1 / 3)
    assert "agent/self_correction_success" not in agent_metrics([clean], success_by_threshold(1.0))
    assert "agent/repeated_failing_call_share" not in agent_metrics([no_tools], success_by_threshold(1.0))
