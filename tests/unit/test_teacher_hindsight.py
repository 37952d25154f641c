"""`teacher_hindsight`: the teacher scores the student's tokens with a note in its context (the reference
answer, or what the tools answered after the call); the student's prompt (sampled on, trained on) never
holds it.

A word-level tokenizer with a ChatML-like template stands in for a model's; the teacher engine is a fake
that records what it was asked to score (the real engines: tests/integration/test_teacher_hindsight.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from chatml_tokenizer import TEMPLATE, chatml_tokenizer

from opd_trainer.chat import prompt_token_ids
from opd_trainer.jobspec.dataset import Sample
from opd_trainer.jobspec.job_spec import parse_job_spec
from opd_trainer.records import LLMCall
from opd_trainer.signal.notes import (
    hindsight_notes,
    outcome_notes,
    reference_note,
    teacher_inputs,
    with_note,
)

NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "what is 2 + 3"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return chatml_tokenizer(tmp_path_factory.mktemp("chatml"), TEMPLATE)


def _call(tokenizer: Any, messages: list[dict[str, Any]], completion: list[int]) -> LLMCall:
    prompt = prompt_token_ids(tokenizer, messages)
    return LLMCall(prompt, completion, [-1.0] * len(completion), messages=messages)


def test_the_note_joins_the_system_message_or_stands_in_front() -> None:
    note = reference_note({"answer": 5})
    assert '{"answer": 5}' in note
    assert with_note(MESSAGES, note) == [{"role": "system", "content": note}, *MESSAGES]
    system = [{"role": "system", "content": "be brief"}, *MESSAGES]
    assert with_note(system, note)[0]["content"] == f"be brief\n\n{note}"
    assert with_note(system, note)[1:] == MESSAGES


def test_the_teacher_scores_the_students_tokens_after_a_prompt_holding_the_reference(tokenizer: Any) -> None:
    call = _call(tokenizer, MESSAGES, [8])
    inputs = teacher_inputs(tokenizer, [(call, reference_note("5")), (call, None)], max_length=512)
    (noted, completion), (plain, _) = inputs.pairs
    assert completion == [8] and plain == call.prompt_token_ids
    assert noted == prompt_token_ids(tokenizer, with_note(MESSAGES, reference_note("5")))
    assert noted[-len(call.prompt_token_ids) + 1 :] == call.prompt_token_ids[1:]  # same conversation after it
    assert inputs.noted == [True, False]


def test_calls_the_note_cannot_reach_are_scored_as_sampled_and_counted(
    tokenizer: Any, tmp_path: Path
) -> None:
    rebuilt_differently = LLMCall([1, 2, 3], [8], [-1.0], messages=MESSAGES)  # not what the template renders
    no_messages = LLMCall([1, 2, 3], [8], [-1.0])
    fits = _call(tokenizer, MESSAGES, [8])
    note = reference_note("5")
    too_long = len(teacher_inputs(tokenizer, [(fits, note)], max_length=512).pairs[0][0])
    inputs = teacher_inputs(
        tokenizer, [(rebuilt_differently, note), (no_messages, note), (fits, note)], max_length=too_long
    )
    assert [prompt for prompt, _ in inputs.pairs] == [[1, 2, 3], [1, 2, 3], fits.prompt_token_ids]
    assert inputs.noted == [False, False, False]
    no_system = chatml_tokenizer(tmp_path, NO_SYSTEM_TEMPLATE)
    refused = _call(no_system, MESSAGES, [8])
    inputs = teacher_inputs(no_system, [(refused, note)], max_length=512)
    assert inputs.pairs == [(refused.prompt_token_ids, [8])] and inputs.noted == [False]


class RecordingTeacher:
    def __init__(self) -> None:
        self.pairs: list[tuple[list[int], list[int]]] = []

    async def score_top_k_many(self, pairs: list[tuple[list[int], list[int]]], top_k: int) -> list[Any]:
        from opd_trainer.engine.vllm_engine import TeacherScores

        self.pairs += pairs
        return [TeacherScores(np.full(len(c), -0.5, dtype=np.float32), None, None) for _, c in pairs]


def test_the_score_phase_scores_with_the_reference_and_trains_on_the_students_prompt(
    tokenizer: Any, tmp_path: Path
) -> None:
    from opd_trainer.driver.teachers import TeacherEngines
    from opd_trainer.rollout.runner import RolloutResult
    from opd_trainer.signal.scores import score_rollouts

    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"messages": MESSAGES, "rollout_extra": {"ground_truth": "5"}}) + "\n")
    spec = parse_job_spec(
        {
            "job_name": "j",
            "model": "s",
            "teacher_model": "self",
            "training_datasets": [str(train)],
            "hyper_parameters": {"teacher_hindsight": "reference"},
        }
    )
    assert spec.teacher_model == "s"  # `self`: the initial student
    teacher = RecordingTeacher()
    sample = Sample("train.jsonl", 1, MESSAGES, None, {"ground_truth": "5"})
    call = _call(tokenizer, MESSAGES, [8])
    result = RolloutResult(0, 0, "r0", sample, calls=[call])
    teachers = TeacherEngines(spec, {"teacher": teacher})  # type: ignore[dict-item]
    segments = asyncio.run(score_rollouts(teachers, tokenizer, 512, spec.hyper_parameters, [result]))
    [(teacher_prompt, completion)] = teacher.pairs
    note_ids = tokenizer.encode(reference_note("5"), add_special_tokens=False)
    assert completion == [8] and _holds(teacher_prompt, note_ids)
    [segment] = segments
    assert segment.prompt_token_ids == call.prompt_token_ids
    assert not _holds(segment.prompt_token_ids, note_ids)
    assert segment.teacher_saw_note


CALL = {"id": "c0", "type": "function", "function": {"name": "query", "arguments": "{}"}}
REPLY = {"role": "assistant", "content": "", "tool_calls": [CALL]}
ERROR = {"role": "tool", "tool_call_id": "c0", "content": '{"error": "item moved", "moved_to": "K-2"}'}


def test_outcome_notes_hold_what_the_tools_answered_after_each_call() -> None:
    first = LLMCall([1], [2], [-1.0], messages=MESSAGES)
    second_messages = [*MESSAGES, REPLY, ERROR]
    second = LLMCall([1], [2], [-1.0], messages=second_messages)
    final = [*second_messages, {"role": "assistant", "content": "K-2 is open"}]
    notes = outcome_notes([first, second], final)
    assert notes[0] is not None and ERROR["content"] in notes[0] and notes[1] is None
    # The last call of a rollout whose agent ran its tools: the rollout's final messages hold them.
    assert outcome_notes([first], [*MESSAGES, REPLY, ERROR, ERROR])[0].count("moved_to") == 2  # type: ignore[union-attr]
    assert outcome_notes([LLMCall([1], [2], [-1.0])], final) == [None]  # no messages recorded


def test_hindsight_notes_follow_the_mode_and_skip_calls_the_teacher_does_not_score() -> None:
    from opd_trainer.rollout.runner import RolloutResult

    sample = Sample("t.jsonl", 1, MESSAGES, None, {"ground_truth": "5"})
    empty = LLMCall([1], [], [], messages=MESSAGES)  # no completion: not a segment, gets no note
    first = LLMCall([1], [2], [-1.0], messages=MESSAGES)
    result = RolloutResult(0, 0, "r0", sample, calls=[empty, first], messages=[*MESSAGES, REPLY, ERROR])
    assert hindsight_notes(result, "none") == [None]
    assert hindsight_notes(result, "reference") == [reference_note("5")]
    [outcome] = hindsight_notes(result, "outcome")
    assert outcome is not None and "moved_to" in outcome


def _holds(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_reference_hindsight_needs_references_in_the_training_data() -> None:
    from opd_trainer.errors import ConfigError
    from opd_trainer.jobspec.preflight import check_references

    bare = Sample("train.jsonl", 1, MESSAGES, None)
    with pytest.raises(ConfigError) as raised:
        check_references([bare], "reference")
    assert raised.value.field == "hyper_parameters.teacher_hindsight"
    check_references([bare], "none")
    check_references([bare, Sample("train.jsonl", 2, MESSAGES, None, {"solution": 5})], "reference")


def test_outcome_hindsight_needs_an_agent() -> None:
    from opd_trainer.errors import ConfigError

    job = {"job_name": "j", "model": "s", "teacher_model": "t", "training_datasets": ["d.jsonl"]}
    with pytest.raises(ConfigError, match=r"hyper_parameters\.teacher_hindsight 'outcome'"):
        parse_job_spec({**job, "hyper_parameters": {"teacher_hindsight": "outcome"}})
    rollout = {"name": "agent", "type": "rollout", "fcmodel": {"zipdir": "w", "classpath": "a.B"}}
    agentic = parse_job_spec(
        {**job, "functions": [rollout], "hyper_parameters": {"teacher_hindsight": "outcome"}}
    )
    assert agentic.hyper_parameters.teacher_hindsight == "outcome"


def _reply(text: str, rollout: int) -> LLMCall:
    return LLMCall([1], [2], [-1.0], text=text, teacher_logprobs=[-1.0], rollout_id=rollout, group_id=0)


def test_a_reply_carrying_the_notes_wording_drops_its_rollout_and_is_counted() -> None:
    from opd_trainer.jobspec.job_spec import HyperParameters
    from opd_trainer.signal.leaks import carries_note_wording, drop_leaks
    from opd_trainer.signal.notes import NOTE_HEADER
    from opd_trainer.signal.shape import shape_signal

    # The header's wording, whatever the case and punctuation, is a leak; what a note reports is not.
    assert carries_note_wording("Sure. (Never shown to the ASSISTANT being trained) the id is 7")
    assert carries_note_wording(NOTE_HEADER.upper())
    assert not carries_note_wording("A correct final answer to this task is: refund(order=7)")
    assert not carries_note_wording("hindsight for scoring")  # three words: too short to tell
    segments = [
        _reply("call refund", rollout=0),
        _reply("hindsight for scoring never shown: refund", rollout=0),  # the rollout's second turn
        _reply("call refund", rollout=1),
    ]
    dropped = drop_leaks(segments)
    assert [s.rollout_id for s in dropped.segments] == [1]
    assert dropped.metrics["hindsight/leaked_rollouts"] == 1.0
    hp = HyperParameters.model_validate({"teacher_hindsight": "reference"})
    shaped = asyncio.run(shape_signal(segments, 0, hp))
    assert shaped.metrics["hindsight/leaked_rollouts"] == 1.0
    assert [s.rollout_id for s in shaped.segments] == [1]
    plain = asyncio.run(shape_signal(segments, 0, HyperParameters()))
    assert "hindsight/leaked_rollouts" not in plain.metrics
