"""The self-correction variant: its training turns, its episodes, the tool backend and the episode judge."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from opd_trainer.demo.tool_routing import make_samples
from opd_trainer.demo.tool_routing.evaluator import message_to_parsed, score_reply
from opd_trainer.demo.tool_routing.self_correction import make_episodes, run_tool, score_episode
from opd_trainer.demo.tool_routing.task import CATEGORIES, SELF_CORRECTION_CATEGORIES, canonical


def _call(name: str, arguments: dict[str, str]) -> dict[str, Any]:
    fn = {"name": name, "arguments": json.dumps(arguments)}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c", "type": "function", "function": fn}],
    }


def _tool(content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": "c", "content": content}


def test_the_default_mix_is_untouched_by_the_variant() -> None:
    """The demo's data (and so its models) must not move when the variant exists beside it."""
    assert make_samples("train", 50, seed=1) == make_samples("train", 50, seed=1, categories=CATEGORIES)
    assert all(s.record["rollout_extra"]["category"] != "retry" for s in make_samples("train", 50))


def test_retry_turns_follow_a_moved_error_and_copy_the_new_id() -> None:
    samples = make_samples("train", 500, seed=0, categories=SELF_CORRECTION_CATEGORIES)
    retries = [s for s in samples if s.record["rollout_extra"]["category"] == "retry"]
    assert len(retries) == 100
    kinds = Counter("call" if s.reference_message.get("tool_calls") else "summary" for s in retries)
    assert min(kinds.values()) > 30, kinds
    for sample in retries:
        messages = sample.record["messages"]
        error = next(json.loads(m["content"]) for m in messages if m["role"] == "tool")
        assert error["error"].endswith("was moved")
        new_id = error["moved_to"]
        if sample.reference_message.get("tool_calls"):
            assert messages[-1]["role"] == "tool"  # the correction answers the error directly
            arguments = json.loads(sample.reference_message["tool_calls"][0]["function"]["arguments"])
            assert arguments["item_id"] == new_id
        else:
            assert new_id in sample.reference_message["content"]
        # The reference scores as an exact match of the decision the solution names.
        parsed = message_to_parsed(sample.reference_message)
        assert score_reply(parsed, sample.record["rollout_extra"]["solution"]).exact_match


def test_episodes_are_split_like_the_task_and_half_of_them_move() -> None:
    train, validation = make_episodes("train", 400), make_episodes("validation", 100)
    keys = {canonical(r["messages"]) for r in train}
    assert not keys & {canonical(r["messages"]) for r in validation}
    assert len(keys) == 400
    moved = [r for r in train if r["rollout_extra"]["moved"]]
    assert 0.35 < len(moved) / len(train) < 0.65
    for record in moved:
        solution = json.loads(record["rollout_extra"]["solution"])
        ((old, new),) = record["rollout_extra"]["moved"].items()
        assert [c["arguments"]["item_id"] for c in solution["tool_calls"]] == [old, new]
    assert make_episodes("validation", 20, seed=3) == make_episodes("validation", 20, seed=3)


def test_the_tool_backend_errors_on_moved_items_only() -> None:
    moved = {"B-1000": "K-2000"}
    assert json.loads(run_tool("query_status", {"item_id": "B-1000"}, moved)) == {
        "error": "item B-1000 was moved",
        "moved_to": "K-2000",
    }
    result = json.loads(run_tool("query_status", {"item_id": "K-2000"}, moved))
    assert result["item_id"] == "K-2000" and "status" in result
    assert json.loads(run_tool("update_priority", {"item_id": "K-2000", "priority": "low"}, moved)) == {
        "ok": True
    }
    assert "error" in json.loads(run_tool("delete_item", {"item_id": "K-2000"}, moved))


def _episode(moved: bool) -> tuple[list[dict[str, Any]], str]:
    calls = [{"name": "query_status", "arguments": {"item_id": "B-1000"}}]
    if moved:
        calls.append({"name": "query_status", "arguments": {"item_id": "K-2000"}})
    opening = [{"role": "system", "content": "s"}, {"role": "user", "content": "Check B-1000."}]
    return opening, json.dumps({"decision": "tool_call", "tool_calls": calls})


def test_an_episode_that_corrects_itself_succeeds() -> None:
    opening, solution = _episode(moved=True)
    messages = [
        *opening,
        _call("query_status", {"item_id": "B-1000"}),
        _tool('{"error": "item B-1000 was moved", "moved_to": "K-2000"}'),
        _call("query_status", {"item_id": "K-2000"}),
        _tool('{"item_id": "K-2000", "status": "open"}'),
        {"role": "assistant", "content": "Item K-2000 is open."},
    ]
    score = score_episode(messages, len(opening), solution)
    assert score.success and score.hit_moved_error and score.self_corrected


def test_repeating_the_failed_call_is_not_a_correction() -> None:
    opening, solution = _episode(moved=True)
    failed = _call("query_status", {"item_id": "B-1000"})
    error = _tool('{"error": "item B-1000 was moved", "moved_to": "K-2000"}')
    messages = [
        *opening,
        failed,
        error,
        failed,
        error,
        {"role": "assistant", "content": "Item K-2000 is open."},
    ]
    score = score_episode(messages, len(opening), solution)
    assert score.hit_moved_error and not score.self_corrected and not score.calls_correct
    assert not score.success


def test_right_calls_without_a_final_answer_are_not_a_success() -> None:
    opening, solution = _episode(moved=False)
    messages = [*opening, _call("query_status", {"item_id": "B-1000"}), _tool('{"status": "open"}')]
    score = score_episode(messages, len(opening), solution)
    assert score.calls_correct and not score.answered and not score.success
    assert not score.hit_moved_error
    # An answer naming another item is not the answer either.
    wrong = [*messages, {"role": "assistant", "content": "Item K-2000 is open."}]
    assert not score_episode(wrong, len(opening), solution).answered


def test_injected_episodes_hold_the_moved_error_and_succeed_only_on_the_correction() -> None:
    from opd_trainer.demo.tool_routing import self_correction
    from opd_trainer.rollout.agent_eval import is_tool_error

    records = self_correction.make_injected_episodes("validation", 12)
    assert len({r["rollout_extra"]["sample_id"] for r in records}) == 12
    for record in records:
        messages, extra = record["messages"], record["rollout_extra"]
        assert messages[-2]["role"] == "assistant" and is_tool_error(messages[-1])
        (remaining,) = json.loads(extra["solution"])["tool_calls"]
        assert remaining["arguments"]["item_id"] in messages[-1]["content"]  # the error names the new id
        start = len(messages)

        def reply(*calls: dict[str, object], text: str = "") -> dict[str, object]:
            tool_calls = [
                {
                    "id": f"c{i}",
                    "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
                }
                for i, c in enumerate(calls)
            ]
            return {"role": "assistant", "content": text, "tool_calls": tool_calls}

        summary = {"role": "assistant", "content": f"Done: {remaining['arguments']['item_id']}."}
        corrected = [*messages, reply(remaining), {"role": "tool", "content": "{}"}, summary]
        assert self_correction.score_episode(corrected, start, extra["solution"]).success
        first = json.loads(messages[-2]["tool_calls"][0]["function"]["arguments"])
        repeated = [
            *messages,
            reply({"name": remaining["name"], "arguments": first}),
            {"role": "tool", "content": "{}"},
            summary,
        ]
        assert not self_correction.score_episode(repeated, start, extra["solution"]).success
