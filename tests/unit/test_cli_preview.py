"""`opd preview`: a dataset as the trainer reads it, on data shaped unlike the demo's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opd_trainer.cli.main import main

MATH = {
    "messages": [
        {"role": "system", "content": "Solve step by step."},
        {"role": "user", "content": "What is 17 * 23?"},
    ],
    "rollout_extra": {"sample_id": "math-1", "solution": {"answer": 391}, "difficulty": "easy"},
}
AGENT = {
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "error: service unavailable"},
    ],
    "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
}


def _dataset(tmp_path: Path, *records: object) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_shows_the_first_samples_as_the_trainer_reads_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _dataset(tmp_path, MATH, AGENT, MATH)
    assert main(["preview", str(path), "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert (
        "== math-1 (data.jsonl:1)" in out
        and '{"answer": 391}' in out
        and "rollout_extra keys: difficulty, sample_id" in out
    )
    assert (
        "== data.jsonl:2 (data.jsonl:2)" in out and "[tool_calls: weather]" in out and "tools: weather" in out
    )
    assert "data.jsonl:3 (" not in out  # -n 2
    assert out.rstrip().endswith("3 samples, all valid")


def test_json_output_is_what_processors_receive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["preview", str(_dataset(tmp_path, MATH)), "-o", "json"]) == 0
    [view] = json.loads(capsys.readouterr().out)
    assert view["ground_truth"] == {"answer": 391} and view["messages"] == MATH["messages"]
    assert view["sample_id"] == "math-1" and view["tools"] == []


def test_every_bad_line_is_named_and_nothing_is_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _dataset(tmp_path, MATH, {"messages": []}, [1])
    assert main(["preview", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "line 2: messages: must be a non-empty list" in captured.err and "line 3:" in captured.err


def test_tokenizer_counts_each_prompt_with_the_chat_template(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "user": 1, ":": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(tmp_path / "tok")
    short = {"messages": [{"role": "user", "content": "hi"}]}
    longer = {"messages": [{"role": "user", "content": "one two three four"}]}
    assert (
        main(["preview", str(_dataset(tmp_path, short, longer)), "--tokenizer", str(tmp_path / "tok")]) == 0
    )
    out = capsys.readouterr().out
    assert "prompt tokens: 3" in out and "prompt tokens: 6" in out  # "user", ":", then the words
    assert "prompt tokens max 6, mean 4" in out  # (3 + 6) / 2 = 4.5, shown rounded


def test_an_unloadable_tokenizer_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["preview", str(_dataset(tmp_path, MATH)), "--tokenizer", str(tmp_path / "missing")]) == 2
    assert "error: tokenizer: cannot load a tokenizer" in capsys.readouterr().err
