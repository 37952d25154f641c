"""The lookup variant: its training turns, its episodes, the tool backend and the episode judge."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from opd_trainer.demo.tiny_models.factory import EPISODES_BY_VARIANT, VARIANTS
from opd_trainer.demo.tool_routing import lookup
from opd_trainer.demo.tool_routing.evaluator import (
    evaluate_texts,
    format_reply,
    message_to_parsed,
    score_reply,
)
from opd_trainer.demo.tool_routing.task import canonical, split_of

ITEMS = {"Alice's blue lamp": "B-1000"}


def _call(name: str, arguments: dict[str, str]) -> dict[str, Any]:
    fn = {"name": name, "arguments": json.dumps(arguments)}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c", "type": "function", "function": fn}],
    }


def _tool(name: str, arguments: dict[str, str]) -> dict[str, Any]:
    """The backend's real answer to the call."""
    return {"role": "tool", "tool_call_id": "c", "content": lookup.run_tool(name, arguments, ITEMS)}


def _text(content: str) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def _exchange(name: str, arguments: dict[str, str]) -> list[dict[str, Any]]:
    return [_call(name, arguments), _tool(name, arguments)]


def test_the_variant_trains_every_turn_of_the_chain() -> None:
    assert VARIANTS["lookup"] == lookup.LOOKUP_CATEGORIES == ("lookup", "call", "repair", "summary")
    assert EPISODES_BY_VARIANT["lookup"] is lookup.make_episodes
    samples = lookup.make_samples("train", 400)
    assert Counter(s.record["rollout_extra"]["category"] for s in samples) == dict.fromkeys(
        lookup.LOOKUP_CATEGORIES, 100
    )
    for sample in samples:
        messages, reference = sample.record["messages"], sample.reference_message
        category = sample.record["rollout_extra"]["category"]
        # One system prompt and tool list for all (the tiny models' prefix sharing needs them).
        assert messages[0]["content"] == lookup.SYSTEM_PROMPT and sample.record["tools"] == lookup.TOOLS
        # The reference is what the backend's answers so far call for.
        results = [json.loads(m["content"]) for m in messages if m["role"] == "tool"]
        if category == "repair":
            assert "error" in results[-1]
        if category == "lookup":
            assert messages[-1]["role"] == "user"
            assert reference["tool_calls"][0]["function"]["name"] == lookup.LOOKUP_TOOL
        if category == "call":
            arguments = json.loads(reference["tool_calls"][0]["function"]["arguments"])
            assert arguments["item_id"] == results[-1]["item_id"]  # exactly the id find_item returned
        if category == "summary":
            assert results[-1].get("item_id", "") in reference["content"] and "error" not in results[-1]
        parsed = message_to_parsed(reference, lookup.TOOL_NAMES)
        assert score_reply(parsed, sample.record["rollout_extra"]["solution"]).exact_match
    # Validation reads a find_item call as well formed (the record's own tools), and scores it.
    lookups = [s for s in samples if s.record["rollout_extra"]["category"] == "lookup"][:5]
    texts = [format_reply(s.reference_message) for s in lookups]
    assert evaluate_texts(texts, [s.record for s in lookups])["exact_match"] == 1.0


def test_repairs_look_up_again_after_each_trained_mistake_and_no_mistake_is_a_reference() -> None:
    samples = lookup.make_samples("train", 800, seed=1)
    repairs = [s for s in samples if s.record["rollout_extra"]["category"] == "repair"]
    # After a guessed id (no lookup yet) and after another id than the one returned (a lookup before).
    kinds = Counter(
        any("name" in m["content"] for m in s.record["messages"] if m["role"] == "tool") for s in repairs
    )
    assert min(kinds[True], kinds[False]) > 60, kinds
    for sample in repairs:
        assert json.loads(sample.record["messages"][-1]["content"])["error"].startswith("no item ")
        assert sample.reference_message["tool_calls"][0]["function"]["name"] == lookup.LOOKUP_TOOL
    for sample in samples:
        messages, reference = sample.record["messages"], sample.reference_message
        results = [json.loads(m["content"]) for m in messages if m["role"] == "tool"]
        found = [r for r in results if "name" in r]
        for call in reference.get("tool_calls") or []:
            arguments = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == lookup.LOOKUP_TOOL:  # the name the user gave, never another
                assert arguments["name"] in messages[1]["content"]
            else:  # the id find_item returned, never a guess
                assert arguments["item_id"] == found[-1]["item_id"]


def test_samples_and_episodes_are_distinct_and_split_by_their_opening() -> None:
    train, validation = lookup.make_samples("train", 300), lookup.make_samples("validation", 100)
    for split, samples in (("train", train), ("validation", validation)):
        assert len({canonical(s.record["messages"]) for s in samples}) == len(samples)
        assert all(split_of(s.record["messages"][:2]) == split for s in samples)
    episodes = {
        "train": lookup.make_episodes("train", 400),
        "validation": lookup.make_episodes("validation", 64),
    }
    openings = {s: {canonical(r["messages"]) for r in records} for s, records in episodes.items()}
    assert len(openings["train"]) == 400 and len(openings["validation"]) == 64
    assert not openings["train"] & openings["validation"]
    assert not {canonical(s.record["messages"][:2]) for s in train} & openings["validation"]
    for split, records in episodes.items():
        for record in records:
            assert split_of(record["messages"]) == split and record["tools"] == lookup.TOOLS
            extra = record["rollout_extra"]
            ((name, item_id),) = extra["items"].items()
            find, action = json.loads(extra["solution"])["tool_calls"]
            assert find == {"name": "find_item", "arguments": {"name": name}}
            assert action["name"] == extra["category"] and action["arguments"]["item_id"] == item_id
            assert (
                name in record["messages"][-1]["content"] and item_id not in record["messages"][-1]["content"]
            )
    assert lookup.make_episodes("validation", 20, seed=3) == lookup.make_episodes("validation", 20, seed=3)


def test_the_backend_answers_the_named_item_and_says_what_was_wrong() -> None:
    assert json.loads(lookup.run_tool("find_item", {"name": "Alice's blue lamp"}, ITEMS)) == {
        "name": "Alice's blue lamp",
        "item_id": "B-1000",
    }
    assert json.loads(lookup.run_tool("find_item", {"name": "Bob's blue lamp"}, ITEMS)) == {
        "error": "no item named Bob's blue lamp"
    }
    assert json.loads(lookup.run_tool("query_status", {"item_id": "K-2000"}, ITEMS)) == {
        "error": "no item K-2000"
    }
    result = json.loads(lookup.run_tool("query_status", {"item_id": "B-1000"}, ITEMS))
    assert result["item_id"] == "B-1000" and result["status"] in ("open", "in_progress", "shipped", "closed")
    assert json.loads(
        lookup.run_tool("update_priority", {"item_id": "B-1000", "priority": "low"}, ITEMS)
    ) == {"ok": True}
    assert "error" in json.loads(lookup.run_tool("delete_item", {"item_id": "B-1000"}, ITEMS))


OPENING = [{"role": "system", "content": "s"}, {"role": "user", "content": "Set Alice's blue lamp to high."}]
FIND = {"name": "Alice's blue lamp"}
ACTION = {"item_id": "B-1000", "priority": "high"}
SOLUTION = json.dumps(
    {
        "decision": "tool_call",
        "tool_calls": [
            {"name": "find_item", "arguments": FIND},
            {"name": "update_priority", "arguments": ACTION},
        ],
    }
)
DONE = _text("Done: B-1000 now has high priority.")


def _score(*turns: dict[str, Any]) -> lookup.EpisodeScore:
    return lookup.score_episode([*OPENING, *turns], len(OPENING), SOLUTION)


def test_a_clean_run_scores_one() -> None:
    score = _score(*_exchange("find_item", FIND), *_exchange("update_priority", ACTION), DONE)
    assert score == lookup.EpisodeScore(calls_correct=True, answered=True, errors=0, clean=True)
    assert score.success and score.reward == 1.0


@pytest.mark.parametrize(
    "mistake",
    [
        [("update_priority", {"item_id": "K-2000", "priority": "high"})],  # skipped the lookup, guessed
        [("find_item", {"name": "Bob's blue lamp"})],  # looked up another name
    ],
)
def test_a_repaired_early_mistake_succeeds_below_a_clean_run(
    mistake: list[tuple[str, dict[str, str]]],
) -> None:
    wrong = [m for name, arguments in mistake for m in _exchange(name, arguments)]
    assert "error" in json.loads(wrong[-1]["content"])
    score = _score(*wrong, *_exchange("find_item", FIND), *_exchange("update_priority", ACTION), DONE)
    assert score.success and not score.clean and score.errors == 1 and score.reward == 0.75


def test_using_another_id_than_the_one_returned_is_repaired_by_the_right_call() -> None:
    wrong = {"item_id": "B-1001", "priority": "high"}
    turns = [*_exchange("find_item", FIND), *_exchange("update_priority", wrong)]
    assert json.loads(turns[-1]["content"]) == {"error": "no item B-1001"}
    assert _score(*turns, DONE).reward == 0.0  # the item never changed: a claim of success is not one
    repaired = _score(*turns, *_exchange("update_priority", ACTION), DONE)
    assert repaired.success and repaired.errors == 1 and repaired.reward == 0.75


def test_wrong_runs_fail() -> None:
    # The right call without the lookup (an id the agent could not have known) is not the task.
    assert not _score(*_exchange("update_priority", ACTION), DONE).calls_correct
    # A wrong change of the right item stays: the final state is wrong even after the right call.
    low = {"item_id": "B-1000", "priority": "low"}
    turns = [
        *_exchange("find_item", FIND),
        *_exchange("update_priority", low),
        *_exchange("update_priority", ACTION),
    ]
    assert _score(*turns, DONE).reward == 0.0
    # The right state without an answer naming the result, or with a wrong one.
    state = [*_exchange("find_item", FIND), *_exchange("update_priority", ACTION)]
    assert _score(*state).reward == 0.25
    assert _score(*state, _text("Done: B-1000 now has low priority.")).reward == 0.25
    # A repeated failing lookup never reaches the item.
    failing = _exchange("find_item", {"name": "Bob's blue lamp"})
    assert _score(*failing, *failing, DONE) == lookup.EpisodeScore(False, True, 2, False)


def test_a_requests_item_name_is_the_same_tokens_as_in_the_lookup_call() -> None:
    """The model can copy the name only if the request holds the very tokens the call's `"name": "..."`
    does: a Chinese request quotes it, or its words merge with the text around it (no spaces to split)."""
    from opd_trainer.demo.tiny_models.factory import VOCAB_SIZE, _train_tokenizer

    samples = lookup.make_samples("train", 800)
    tokenizer = _train_tokenizer(samples)
    for sample in samples[:: len(lookup.LOOKUP_CATEGORIES)][:40]:  # the lookup turns
        request = sample.record["messages"][1]["content"]
        name = json.loads(sample.reference_message["tool_calls"][0]["function"]["arguments"])["name"]
        in_call = tokenizer.encode(json.dumps({"name": name}, ensure_ascii=False)).ids
        name_ids = in_call[in_call.index(tokenizer.token_to_id('Ġ"')) + 1 : -1]  # between Ġ" and "}
        request_ids = tokenizer.encode(request).ids
        at = [i for i in range(len(request_ids)) if request_ids[i : i + len(name_ids)] == name_ids]
        assert at, (request, name)
    assert tokenizer.get_vocab_size() <= VOCAB_SIZE


def test_the_variants_student_comes_from_its_own_band() -> None:
    """The lookup build takes its student at 0.5-0.7 turn exact match (an episode needs three right turns
    in a row); the other variants at 0.3-0.45 and at most half of the teacher's."""
    from opd_trainer.demo.tiny_models.factory import _Checkpoint, _pick_student, targets

    def checkpoint(step: int, exact_match: float) -> _Checkpoint:
        return _Checkpoint(step, {"exact_match": exact_match, "format_validity": 1.0}, {})

    climb = [checkpoint(20, 0.31), checkpoint(60, 0.47), checkpoint(80, 0.55), checkpoint(100, 0.675)]
    assert _pick_student(climb, 0.895, targets("lookup")).step == 80
    assert _pick_student(climb, 0.955, targets()).step == 20
    assert targets("lookup").teacher == 0.88 and targets("self_correction") == targets()


def test_injected_episodes_open_with_a_wrong_turn_answered_by_the_backends_error() -> None:
    from opd_trainer.rollout.agent_eval import is_tool_error

    records = lookup.make_injected_episodes("validation", 60, seed=2)
    assert records == lookup.make_injected_episodes("validation", 60, seed=2)
    assert len({canonical(r["messages"]) for r in records}) == 60
    assert Counter(r["rollout_extra"]["mistake"] for r in records) == dict.fromkeys(lookup.MISTAKES, 20)
    assert len({r["rollout_extra"]["sample_id"] for r in records}) == 60
    train_openings = {canonical(s.record["messages"][:2]) for s in lookup.make_samples("train", 300)}
    for record in records:
        messages, extra = record["messages"], record["rollout_extra"]
        assert split_of(messages[:2]) == "validation" and canonical(messages[:2]) not in train_openings
        # The history ends on the backend's error to the injected call, which validation reads as a
        # deliberately wrong history (`agent/self_correction_success`).
        assert messages[-1]["role"] == "tool" and is_tool_error(messages[-1])
        assert all(m["tool_call_id"].startswith("call_injected_") for m in messages if m["role"] == "tool")
        ((name, item_id),) = extra["items"].items()
        calls = [c["function"] for m in messages if m["role"] == "assistant" for c in m["tool_calls"]]
        if extra["mistake"] == "wrong_id":  # the right lookup, then another id than it returned
            assert json.loads(messages[3]["content"]) == {"name": name, "item_id": item_id}
            assert json.loads(calls[-1]["arguments"])["item_id"] != item_id
        elif extra["mistake"] == "wrong_name":
            assert json.loads(calls[0]["arguments"])["name"] != name
        else:  # skipped the lookup: a guessed id
            assert calls[0]["name"] == extra["category"] and len(calls) == 1


def _replay(record: dict[str, Any], *calls: tuple[str, dict[str, str]]) -> list[dict[str, Any]]:
    """The record's opening with the agent's `calls` run against the episode's backend."""
    items = record["rollout_extra"]["items"]
    turns: list[dict[str, Any]] = []
    for name, arguments in calls:
        answer = lookup.run_tool(name, arguments, items)
        turns += [_call(name, arguments), {"role": "tool", "tool_call_id": "c", "content": answer}]
    return [*record["messages"], *turns]


@pytest.mark.parametrize("mistake", lookup.MISTAKES)
def test_an_injected_mistake_is_not_the_agents_and_success_means_it_was_repaired(mistake: str) -> None:
    record = next(
        r for r in lookup.make_injected_episodes("validation", 9) if r["rollout_extra"]["mistake"] == mistake
    )
    start, solution = len(record["messages"]), record["rollout_extra"]["solution"]
    find, action = json.loads(solution)["tool_calls"]
    result = json.loads(
        lookup.run_tool(action["name"], action["arguments"], record["rollout_extra"]["items"])
    )
    named = result.get("status") or action["arguments"].get("priority")
    done = _text(f"Done: {action['arguments']['item_id']} {named}")

    def score(*calls: tuple[str, dict[str, str]], answer: bool = True) -> lookup.EpisodeScore:
        messages = _replay(record, *calls)
        return lookup.score_episode([*messages, done] if answer else messages, start, solution)

    # The repair the variant trains (look up again, call on the returned id): a clean run, no own error.
    repaired = score((find["name"], find["arguments"]), (action["name"], action["arguments"]))
    assert repaired == lookup.EpisodeScore(calls_correct=True, answered=True, errors=0, clean=True)
    # Answering without repairing, or repeating the injected call, is no success.
    assert not score().success
    wrong = json.loads(record["messages"][-2]["tool_calls"][0]["function"]["arguments"])
    wrong_name = record["messages"][-2]["tool_calls"][0]["function"]["name"]
    repeated = score((wrong_name, wrong))
    assert not repeated.success and repeated.errors == 1
    # The right call alone succeeds only where the history already looked the item up (after wrong_id).
    direct = score((action["name"], action["arguments"]))
    assert direct.success is (mistake == "wrong_id")
    if direct.success:
        assert not direct.clean and direct.reward == 0.75
