"""Tiny-model tokenizer and chat template: training, round trips, markers (no torch, no transformers)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from opd_trainer.demo.tiny_models.tokenizer import (
    IM_END,
    IM_START,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
    render_chat,
    train_tokenizer,
)
from opd_trainer.demo.tool_routing import task

VOCAB = 800


def _conversation(sample: task.Sample) -> str:
    return render_chat([*sample.record["messages"], sample.reference_message], sample.record["tools"])


@pytest.fixture(scope="module")
def samples() -> list[task.Sample]:
    return task.make_samples("train", 200, seed=0)


@pytest.fixture(scope="module")
def tokenizer(samples: list[task.Sample]) -> Tokenizer:
    return train_tokenizer([_conversation(s) for s in samples], VOCAB)


def test_vocabulary_layout(tokenizer: Tokenizer) -> None:
    assert tokenizer.get_vocab_size() <= VOCAB
    assert [tokenizer.token_to_id(t) for t in (*SPECIAL_TOKENS, *TOOL_TOKENS)] == list(range(7))
    added = {t.content: t.special for t in tokenizer.get_added_tokens_decoder().values()}
    assert added == {**dict.fromkeys(SPECIAL_TOKENS, True), **dict.fromkeys(TOOL_TOKENS, False)}


def test_training_is_deterministic(samples: list[task.Sample], tokenizer: Tokenizer) -> None:
    again = train_tokenizer([_conversation(s) for s in samples], VOCAB)
    assert again.to_str() == tokenizer.to_str()


def test_round_trip_on_unseen_conversations(tokenizer: Tokenizer) -> None:
    for sample in task.make_samples("validation", 40, seed=0):
        text = _conversation(sample)
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text
    odd = 'Ünïcödé ✓ 表情 🙂 tabs\tand\r\nnewlines, "quotes" {json: [1, 2]}'
    assert tokenizer.decode(tokenizer.encode(odd).ids) == odd


def test_markers_are_single_tokens_that_survive_skip_special(tokenizer: Tokenizer) -> None:
    reply = (
        '<tool_call>\n{"name": "query_status", "arguments": {"item_id": "A-1234"}}\n</tool_call><|im_end|>'
    )
    ids = tokenizer.encode(reply).ids
    assert ids[0] == tokenizer.token_to_id("<tool_call>")
    assert ids[-2:] == [tokenizer.token_to_id("</tool_call>"), tokenizer.token_to_id(IM_END)]
    assert tokenizer.decode(ids, skip_special_tokens=True) == reply.removesuffix(IM_END)
    for marker in (*SPECIAL_TOKENS, *TOOL_TOKENS):
        assert tokenizer.encode(marker).ids == [tokenizer.token_to_id(marker)]


def test_copied_values_tokenize_alike_in_prose_and_json(tokenizer: Tokenizer) -> None:
    # The pre-tokenizer keeps letters apart from a preceding space or quote (see PRETOKENIZE_REGEX).
    prose = tokenizer.encode("Change B-5267 to low priority.").tokens
    as_json = tokenizer.encode('{"item_id": "B-5267", "priority": "low"}').tokens
    for piece in (["B", "-", "5", "2", "6", "7"], ["low"]):
        assert any(prose[i : i + len(piece)] == piece for i in range(len(prose)))
        assert any(as_json[i : i + len(piece)] == piece for i in range(len(as_json)))


def test_template_renders_chatml_with_tools_and_grouped_tool_results() -> None:
    tools = task.TOOLS[:1]
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "query_status", "arguments": '{"item_id": "A-1"}'},
    }
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Status of A-1 and A-2?"},
        {"role": "assistant", "content": "", "tool_calls": [call, call]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"status": "open"}'},
        {"role": "tool", "tool_call_id": "c1", "content": '{"status": "closed"}'},
    ]
    text = render_chat(messages, tools, add_generation_prompt=True)
    assert text.startswith(f"{IM_START}system\nBe brief.\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(tools[0], ensure_ascii=False)}\n</tools>" in text
    call_text = '<tool_call>\n{"name": "query_status", "arguments": {"item_id": "A-1"}}\n</tool_call>'
    assert f"{IM_START}assistant\n{call_text}\n{call_text}{IM_END}\n" in text
    results = '<tool_response>\n{"status": "open"}\n</tool_response>\n<tool_response>\n{"status": "closed"}\n'
    assert f"{IM_START}user\n{results}</tool_response>{IM_END}\n" in text
    assert text.endswith(f"{IM_START}assistant\n")
    assert text.count(IM_START) == text.count(IM_END) + 1
    assert render_chat(messages[1:2]) == f"{IM_START}user\nStatus of A-1 and A-2?{IM_END}\n"
    assert render_chat(messages[1:2], tools).startswith(f"{IM_START}system\nYou are a helpful assistant.\n\n")


def test_tool_call_json_is_the_same_from_a_string_or_a_dict() -> None:
    args = {"item_id": "A-1", "reason": "重复"}
    as_string = {"name": "delete_item", "arguments": json.dumps(args, ensure_ascii=False)}
    as_dict = {"name": "delete_item", "arguments": args}
    render = [
        render_chat([{"role": "assistant", "content": "", "tool_calls": [{"function": fn}]}])
        for fn in (as_string, as_dict)
    ]
    assert render[0] == render[1]
    body = render[0].split("<tool_call>")[1].split("</tool_call>")[0]
    assert json.loads(body.strip()) == {"name": "delete_item", "arguments": args}


def test_every_sample_renders_prefix_stable(samples: list[task.Sample]) -> None:
    # What the model is trained to emit after the generation prompt is exactly the reference turn.
    for sample in samples:
        prompt = render_chat(sample.record["messages"], sample.record["tools"], add_generation_prompt=True)
        full = _conversation(sample)
        assert full.startswith(prompt)
        reply = full[len(prompt) :].removesuffix(f"{IM_END}\n")
        calls = sample.reference_message.get("tool_calls") or []
        if calls:
            parsed = json.loads(reply.removeprefix("<tool_call>").removesuffix("</tool_call>").strip())
            assert parsed == {
                "name": calls[0]["function"]["name"],
                "arguments": json.loads(calls[0]["function"]["arguments"]),
            }
        else:
            assert reply == sample.reference_message["content"]
