"""Hindsight for the teacher: context the teacher scores with and the student never sees.

`hyper_parameters.teacher_hindsight` picks the note:

- `reference`: every LLM call of a rollout whose sample has a reference answer
  (`rollout_extra.ground_truth`, else `.solution`) gets the reference.
- `outcome`: every LLM call after which the agent ran tools gets what those tools answered (the next
  call's conversation, or the rollout's final one, holds them): a call that hit an error is scored by a
  teacher that knows the error that followed.

The teacher scores the call's conversation with the note added as a system message in front, or
appended to the system message the conversation already has. The completion scored is the student's,
token for token; the student's prompt (what it was sampled on and what the learner trains it on) is
untouched. So the teacher's log-probabilities are those of a model that knows where the task should end
up (a hindsight beacon, kept out of what the model sees at inference), which is what lets the initial
student serve as its own teacher (`teacher_model: self`).

The note is placed by re-rendering the call's messages with the chat template. A call whose prompt
cannot be rebuilt exactly from its messages (the rendering differs from the ids it was sampled on),
one whose template refuses the note's system message, and one the note would push past
`max_length`, are scored without it and counted. A reply that carries a note's wording is dropped
(`leaks.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from opd_trainer.chat import prompt_token_ids
from opd_trainer.engine.lengths import completion_room
from opd_trainer.jobspec.dataset import ground_truth_of
from opd_trainer.records import LLMCall

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from opd_trainer.rollout.runner import RolloutResult

NOTE_HEADER = "Hindsight for scoring (never shown to the assistant being trained):"
NOTE = NOTE_HEADER + " a correct final answer to this task is: {reference}"
OUTCOME_NOTE = NOTE_HEADER + " after this reply, the tools answered: {results}"
BEACON_HEADER = "Hindsight beacon (what followed this point in an earlier attempt; never shown in training):"
"""The header of a hindsight beacon (`beacons.py`): the model that rewrites a turn reads it."""


def tool_answers(calls: list[LLMCall], final_messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Per call of one rollout (call order), the tool messages that answered it: those between its
    conversation plus its reply and the next call's conversation (the rollout's final messages after the
    last call); [] where no tool answered it, or the call recorded no messages."""
    answers: list[list[dict[str, Any]]] = []
    for index, call in enumerate(calls):
        after = calls[index + 1].messages if index + 1 < len(calls) else final_messages
        start = len(call.messages) + 1  # the call's conversation, then its reply
        following = []
        for message in after[start:] if call.messages else []:
            if message.get("role") != "tool":
                break
            following.append(message)
        answers.append(following)
    return answers


def outcome_notes(calls: list[LLMCall], final_messages: list[dict[str, Any]]) -> list[str | None]:
    """Per call of one rollout (call order), the note on what the tools answered after it
    (`tool_answers`); None where no tool answered it."""
    notes: list[str | None] = []
    for answers in tool_answers(calls, final_messages):
        results = " | ".join(str(m.get("content") or "") for m in answers)
        notes.append(OUTCOME_NOTE.format(results=results) if answers else None)
    return notes


def reference_note(reference: Any) -> str:
    """The note for one sample's reference answer (JSON for anything but a string)."""
    text = reference if isinstance(reference, str) else json.dumps(reference, ensure_ascii=False)
    return NOTE.format(reference=text)


def with_note(messages: list[dict[str, Any]], note: str) -> list[dict[str, Any]]:
    """`messages` with `note` appended to their leading system message, or in one put in front."""
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{note}"}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def hindsight_notes(result: RolloutResult, mode: str) -> list[str | None]:
    """The note for each call of `result` the teacher scores (those with completion tokens, in call
    order) under `teacher_hindsight: mode`; None: scored as sampled."""
    notes: list[str | None] = [None] * len(result.calls)
    if mode == "reference":
        reference = ground_truth_of(result.sample)
        if reference is not None:
            notes = [reference_note(reference)] * len(result.calls)
    elif mode == "outcome":
        notes = outcome_notes(result.calls, result.messages)
    return [note for call, note in zip(result.calls, notes, strict=True) if call.completion_token_ids]


@dataclass(frozen=True)
class TeacherInputs:
    """What the teacher scores: one (prompt ids, completion ids) pair per call, and per call whether
    its prompt carries the note."""

    pairs: list[tuple[list[int], list[int]]]
    noted: list[bool]


def teacher_inputs(
    tokenizer: PreTrainedTokenizerBase,
    calls: list[tuple[LLMCall, str | None]],
    max_length: int,
) -> TeacherInputs:
    """The teacher's view of each (call, note) pair; a None note leaves the call as sampled."""
    pairs: list[tuple[list[int], list[int]]] = []
    noted: list[bool] = []
    for call, note in calls:
        prompt = call.prompt_token_ids
        if note is not None:
            with_note_ids = noted_prompt(tokenizer, call, note)
            noted_length = len(with_note_ids) + len(call.completion_token_ids)
            if with_note_ids and completion_room(max_length, noted_length) >= 0:
                prompt = with_note_ids
        pairs.append((prompt, call.completion_token_ids))
        noted.append(prompt is not call.prompt_token_ids)
    return TeacherInputs(pairs, noted)


def noted_prompt(tokenizer: PreTrainedTokenizerBase, call: LLMCall, note: str) -> list[int]:
    """The call's prompt re-rendered with `note` (`with_note`); [] when its messages do not rebuild its
    prompt, or its template refuses the note."""
    if not call.messages:
        return []
    rebuilt = prompt_token_ids(tokenizer, call.messages, call.tools, call.template_kwargs)
    if rebuilt != call.prompt_token_ids:
        return []
    try:
        return prompt_token_ids(tokenizer, with_note(call.messages, note), call.tools, call.template_kwargs)
    except TemplateError:  # a template that refuses a system message (or one where it stands)
        return []
