"""Hindsight beacons (`signal/beacons.py`): a turn whose tool calls got an error is written again
by a model that reads what followed it, and the rewrite is trained as the chosen action for the turn's
own context, never distilled, with the beacon nowhere in what is trained.

The engines are fakes that record what they were asked (the real ones: tests/integration); the tokenizer
is a word-level one with a ChatML-like template.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import numpy as np
import pytest
import torch
from chatml_tokenizer import chatml_tokenizer

from opd_trainer.chat import prompt_token_ids
from opd_trainer.driver.teachers import Scored
from opd_trainer.engine.vllm_engine import TeacherScores
from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.dataset import Sample
from opd_trainer.jobspec.job_spec import parse_job_spec
from opd_trainer.learner.batch import pad_segments
from opd_trainer.learner.deepspeed_learner import trained_tokens
from opd_trainer.records import CHOSEN, REJECTED, LLMCall
from opd_trainer.rollout.runner import RolloutResult
from opd_trainer.sdk import Beacon, BeaconOutput, BeaconTurn, BeaconVerdict, TaskStatus
from opd_trainer.seeds import request_seed
from opd_trainer.signal.beacons import (
    REWRITE_SEED_OFFSET,
    USER_BEACON,
    BeaconModels,
    ParseReply,
    Reply,
    beacon_for,
    beacons_by_turn,
    reference_progress,
    rewrite_with_beacons,
)
from opd_trainer.signal.notes import BEACON_HEADER, with_note

QUESTION = [{"role": "user", "content": "what is 2 + 3"}]
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
REPLY = {"role": "assistant", "content": "", "tool_calls": [CALL]}
ERROR = {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"error": "add takes x and y"})}
GOOD = {"role": "tool", "tool_call_id": "c1", "content": "5"}
FINAL = {"role": "assistant", "content": "5"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return chatml_tokenizer(tmp_path_factory.mktemp("chatml"))


def test_a_beacon_says_what_the_turn_did_and_what_the_tools_answered_only_after_an_error() -> None:
    call = LLMCall([1], [2], [-1.0], response_message=REPLY)
    beacon = beacon_for(call, [ERROR])
    assert beacon is not None and beacon.startswith(BEACON_HEADER)
    assert 'add({"a": 2, "b": 3})' in beacon and "add takes x and y" in beacon
    assert beacon_for(call, [GOOD]) is None and beacon_for(call, []) is None
    text_reply = LLMCall([1], [2], [-1.0], text="it is 6")
    assert '"it is 6"' in (beacon_for(text_reply, [{"role": "tool", "content": "Error: no such tool"}]) or "")


class FakeGroup:
    """An engine group that answers `generate_many` with the completions it is given, in turn."""

    def __init__(self, completions: list[tuple[list[int], str, str]]) -> None:
        self.completions = list(completions)
        self.prompts: list[list[int]] = []
        self.sampling: dict[str, Any] = {}
        self.seeds: list[int] = []

    async def generate_many(
        self, prompts: list[list[int]], seeds: list[int], **sampling: Any
    ) -> list[LLMCall]:
        self.prompts += prompts
        self.seeds = seeds
        self.sampling = sampling
        out = []
        for prompt in prompts:
            ids, text, finish = self.completions.pop(0)
            out.append(LLMCall(prompt, ids, [-0.5] * len(ids), text=text, finish_reason=finish))
        return out


@dataclasses.dataclass
class FakeTeachers:
    groups: dict[str, FakeGroup]
    scored: list[tuple[list[int], list[int]]] = dataclasses.field(default_factory=list)

    def name_for(self, sample: Sample) -> str:
        return "teacher"

    async def score_top_k(self, names: list[str], pairs: list[Any], top_k: int) -> list[Scored]:
        self.scored += pairs
        return [
            Scored(
                TeacherScores(
                    np.full(len(c), -0.25, dtype=np.float32),
                    np.zeros((len(c), 0), np.int32),
                    np.zeros((len(c), 0)),
                ),
                "teacher",
                0.01,
            )
            for _, c in pairs
        ]


@dataclasses.dataclass
class FakeJob:
    """A job's spec and the fakes of the parts beacons use."""

    spec: Any
    tokenizer: Any
    teachers: FakeTeachers
    student: FakeGroup
    max_length: int = 512
    beacon_pool: Any = None


def rewritten(
    job: FakeJob,
    results: list[RolloutResult],
    segments: list[LLMCall],
    step: int,
    parse: ParseReply | None = None,
) -> tuple[list[LLMCall], list[LLMCall], dict[str, float]]:
    """`rewrite_with_beacons` for `job`: the marked segments, the rewrites and the metrics."""
    models = BeaconModels(
        job.teachers, job.student, job.tokenizer, job.max_length, job.spec.tool_call_parser, job.beacon_pool
    )
    shaped = asyncio.run(
        rewrite_with_beacons(models, job.spec.hyper_parameters, results, segments, step, parse)
    )
    return shaped.segments, shaped.rewrites, shaped.metrics


AGENT = {"name": "agent", "type": "rollout", "fcmodel": {"zipdir": "/w", "classpath": "a.B"}}


def _job(hyper_parameters: dict[str, Any], functions: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "job_name": "beacons",
        "model": "/m",
        "teacher_model": "/t",
        "training_datasets": ["/d.jsonl"],
        "functions": functions,
        "hyper_parameters": hyper_parameters,
    }


def _spec(rewriter: str, **hyper_parameters: Any) -> Any:
    hp = {"turn_preference_coef": 0.5, "beacon_rewrite": rewriter, "max_tokens": 16, **hyper_parameters}
    return parse_job_spec(_job(hp, [AGENT]))


def _rollout(tokenizer: Any, index: int, answer: dict[str, Any], completion: list[int]) -> RolloutResult:
    """A two-turn rollout: a tool call answered by `answer`, then a final reply."""
    first = LLMCall(
        prompt_token_ids(tokenizer, QUESTION), completion, [-1.0] * len(completion),
        messages=QUESTION, response_message=REPLY, text="add",
    )  # fmt: skip
    second_messages = [*QUESTION, REPLY, answer]
    second = LLMCall(
        prompt_token_ids(tokenizer, second_messages), [9], [-1.0], messages=second_messages, text="5"
    )
    sample = Sample("train.jsonl", 0, QUESTION, None)
    return RolloutResult(
        0, index, f"r{index}", sample, [first, second], [*second_messages, FINAL], reward=index
    )


def _segments(results: list[RolloutResult]) -> list[LLMCall]:
    """As the score phase makes them: copies of the calls with the rollout, reward and teacher scores."""
    return [
        dataclasses.replace(
            c, rollout_id=r.index, group_id=r.group_id, reward=r.reward, teacher_logprobs=[-1.0]
        )
        for r in results
        for c in r.calls
    ]


def test_the_rewrite_is_chosen_for_the_turns_own_prompt_and_never_distilled(tokenizer: Any) -> None:
    erred, fine = _rollout(tokenizer, 0, ERROR, [7]), _rollout(tokenizer, 1, GOOD, [8])
    segments = _segments([erred, fine])
    segments[3] = dataclasses.replace(segments[3], preference_pairs=((0, CHOSEN),))  # a mined pair's
    teacher = FakeGroup([([6, 6], "add(x=2, y=3)", "stop")])
    c = FakeJob(_spec("teacher"), tokenizer, FakeTeachers({"teacher": teacher}), FakeGroup([]))

    marked, rewrites, metrics = rewritten(c, [erred, fine], segments, 3)

    # No reference lists tool calls here: nothing can check the rewrite, so it is kept as unverifiable.
    assert metrics == {
        "beacons/turns": 1.0, "beacons/pairs": 1.0, "beacons/unchanged": 0.0,
        "beacons/cut_off": 0.0, "beacons/leaked": 0.0, "beacons/unverified": 0.0, "beacons/skipped": 0.0,
        "beacons/verified": 0.0, "beacons/unverifiable": 1.0, "beacons/outcome": 0.0,
    }  # fmt: skip
    # The rewriting model read the turn's conversation with the beacon, greedily.
    [asked] = teacher.prompts
    beacon = beacon_for(erred.calls[0], [ERROR])
    assert beacon is not None and asked == prompt_token_ids(tokenizer, with_note(QUESTION, beacon))
    assert teacher.sampling == {"max_tokens": 16, "temperature": 0.0}
    assert teacher.seeds == [request_seed(c.spec.hyper_parameters.seed, 3, REWRITE_SEED_OFFSET + 0)]
    # What is trained: the turn's own prompt (no beacon) and the rewrite's tokens, scored there.
    [row] = rewrites
    assert row.prompt_token_ids == segments[0].prompt_token_ids and row.completion_token_ids == [6, 6]
    assert c.teachers.scored == [(segments[0].prompt_token_ids, [6, 6])]
    assert row.teacher_logprobs == [-0.25, -0.25] and not row.distilled and row.rollout_id == 0
    assert row.beacon == beacon  # for the trajectory view, beside the turn; never trained
    # The pair: a fresh id after the mined pairs', the rewrite chosen, the turn rejected; nothing else marked.
    assert row.preference_pairs == ((1, CHOSEN),)
    assert marked[0].preference_pairs == ((1, REJECTED),)
    assert [s.preference_pairs for s in marked[1:]] == [(), (), ((0, CHOSEN),)]
    assert all(s.distilled for s in marked)


@pytest.mark.parametrize(
    ("completion", "counted"),
    [
        (([7], "add", "stop"), "beacons/unchanged"),  # the turn again
        (([6, 6], "add(x=2", "length"), "beacons/cut_off"),
        (([6, 6], "Hindsight beacon (what followed this point ...", "stop"), "beacons/leaked"),
    ],
)
def test_a_rewrite_that_repeats_is_cut_off_or_leaks_the_beacon_is_dropped(
    tokenizer: Any, completion: tuple[list[int], str, str], counted: str
) -> None:
    erred = _rollout(tokenizer, 0, ERROR, [7])
    student = FakeGroup([completion])
    c = FakeJob(_spec("student"), tokenizer, FakeTeachers({"teacher": FakeGroup([])}), student)
    marked, rewrites, metrics = rewritten(c, [erred], _segments([erred]), 0)
    assert len(student.prompts) == 1  # the student's engines rewrote it
    assert rewrites == [] and metrics[counted] == 1.0 and metrics["beacons/pairs"] == 0.0
    assert all(s.preference_pairs == () for s in marked)


def test_a_turn_already_chosen_or_whose_prompt_cannot_be_rebuilt_is_skipped(tokenizer: Any) -> None:
    erred, other = _rollout(tokenizer, 0, ERROR, [7]), _rollout(tokenizer, 1, ERROR, [8])
    segments = _segments([erred, other])
    segments[0] = dataclasses.replace(segments[0], preference_pairs=((0, CHOSEN),))
    segments[2] = dataclasses.replace(segments[2], prompt_token_ids=[1, *segments[2].prompt_token_ids])
    erred.calls[0] = segments[0]  # the same ids the segment has, so it is found
    other.calls[0] = dataclasses.replace(other.calls[0], prompt_token_ids=segments[2].prompt_token_ids)
    c = FakeJob(_spec("teacher"), tokenizer, FakeTeachers({"teacher": FakeGroup([])}), FakeGroup([]))
    _, rewrites, metrics = rewritten(c, [erred, other], segments, 0)
    assert rewrites == [] and metrics["beacons/turns"] == 2.0 and metrics["beacons/skipped"] == 2.0


def test_a_rewrite_row_carries_the_preference_term_only() -> None:
    turn = LLMCall([1, 2], [3, 4], [-1.0, -1.0], teacher_logprobs=[-1.0, -1.0])
    rewrite = dataclasses.replace(
        turn, completion_token_ids=[5], sampler_logprobs=[-0.5], teacher_logprobs=[-0.5]
    )
    rewrite = dataclasses.replace(rewrite, distilled=False)
    batch = pad_segments([turn, rewrite], 0, "cpu")
    assert batch.mask_B_T.tolist() == [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert batch.completion_mask_B_T.tolist() == [[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]]
    assert trained_tokens([turn, rewrite]) == 2.0
    assert torch.equal(batch.mask_B_T[0], batch.completion_mask_B_T[0])


def test_beacon_rewrite_needs_the_preference_term_and_an_agent() -> None:
    with pytest.raises(ConfigError, match="turn_preference_coef") as no_term:
        parse_job_spec(_job({"beacon_rewrite": "teacher"}, [AGENT]))
    assert no_term.value.field == "hyper_parameters.beacon_rewrite"
    with pytest.raises(ConfigError, match="rollout component"):
        parse_job_spec(_job({"beacon_rewrite": "student", "turn_preference_coef": 1.0}, []))
    assert _spec("teacher").hyper_parameters.beacon_rewrite == "teacher"


def test_sampled_rewrites_have_a_seed_per_step_and_turn(tokenizer: Any) -> None:
    erred, other = _rollout(tokenizer, 0, ERROR, [7]), _rollout(tokenizer, 1, ERROR, [8])
    student = FakeGroup([([6], "x", "stop"), ([5], "y", "stop")])
    c = FakeJob(_spec("student", beacon_temperature=0.7, seed=4), tokenizer, FakeTeachers({}), student)
    _, rewrites, _ = rewritten(c, [erred, other], _segments([erred, other]), 2)
    assert student.sampling == {"max_tokens": 16, "temperature": 0.7}
    # Segments 0 and 2 are the two turns that got the error.
    assert student.seeds == [request_seed(4, 2, REWRITE_SEED_OFFSET + i) for i in (0, 2)]
    assert [r.completion_token_ids for r in rewrites] == [[6], [5]]


class FakeBeaconPool:
    """A beacon component's pool: answers each rollout with `answer(turns)` and each rewrite with
    `verdict(call)` (default: not checked), recording what it was given."""

    def __init__(self, answer: Any, verdict: Any = None) -> None:
        self.answer = answer
        self.verdict = verdict or (lambda call: BeaconVerdict())
        self.calls: list[dict[str, Any]] = []
        self.verify_calls: list[dict[str, Any]] = []

    async def beacons(self, **call: Any) -> BeaconOutput:
        self.calls.append(call)
        result: BeaconOutput = self.answer(call["rollout_id"], call["turns"])
        return result

    async def verify(self, **call: Any) -> BeaconVerdict:
        self.verify_calls.append(call)
        result: BeaconVerdict = self.verdict(call)
        return result


def _with_pool(tokenizer: Any, pool: FakeBeaconPool) -> FakeJob:
    spec = parse_job_spec(
        _job(
            {"turn_preference_coef": 0.5, "beacon_rewrite": "student", "max_tokens": 16},
            [AGENT, {"name": "coach", "type": "beacon", "fcmodel": {"zipdir": "/w", "classpath": "b.C"}}],
        )
    )
    student = FakeGroup([([6], "add(x=2, y=3)", "stop")] * 4)
    return FakeJob(spec, tokenizer, FakeTeachers({}), student, beacon_pool=pool)


def test_a_beacon_component_writes_the_beacons_instead_of_the_rule(tokenizer: Any) -> None:
    """The component gets each rollout's trained turns (its reply, what answered it, the rollout's reward
    and reference) and its feedback, under the beacon header, is what the rewriting model reads; a turn
    the rule would beacon (a tool error) gets none unless the component writes one."""

    def answer(rollout_id: str, turns: list[BeaconTurn]) -> BeaconOutput:
        # Feedback on the final reply of r1 only (no tool error there: the rule would say nothing).
        return BeaconOutput(beacons=[Beacon(turn=1, feedback="5 is right but say it as a sentence.")])

    pool = FakeBeaconPool(answer)
    c = _with_pool(tokenizer, pool)
    erred, fine = _rollout(tokenizer, 0, ERROR, [7]), _rollout(tokenizer, 1, GOOD, [8])
    erred.sample.rollout_extra["solution"] = {"sum": 5}
    segments = _segments([erred, fine])
    marked, rewrites, metrics = rewritten(c, [erred, fine], segments, 0)

    assert [call["rollout_id"] for call in pool.calls] == ["r0", "r1"]
    first = pool.calls[0]
    assert first["ground_truth"] == {"sum": 5} and first["reward"] == 0 and first["sample_id"]
    assert [t.turn for t in first["turns"]] == [0, 1]
    assert first["turns"][0].reply == REPLY and first["turns"][0].tool_answers == [ERROR]
    assert first["turns"][1].messages == [*QUESTION, REPLY, ERROR]
    assert first["agent_output"].messages == [*QUESTION, REPLY, ERROR, FINAL]
    # Both rollouts got the same feedback for their turn 1: two rewrites, no rule beacon for r0's error.
    feedback = USER_BEACON.format(feedback="5 is right but say it as a sentence.")
    assert c.student.prompts == [
        prompt_token_ids(tokenizer, with_note(segments[i].messages, feedback)) for i in (1, 3)
    ]
    assert metrics["beacons/turns"] == 2.0 and metrics["beacons/pairs"] == 2.0
    assert metrics["beacons/failed"] == 0.0 and metrics["beacons/unknown_turn"] == 0.0
    assert [r.prompt_token_ids for r in rewrites] == [segments[i].prompt_token_ids for i in (1, 3)]
    assert marked[0].preference_pairs == ()


def test_a_failing_or_stray_beacon_component_is_counted_and_the_step_goes_on(tokenizer: Any) -> None:
    def answer(rollout_id: str, turns: list[BeaconTurn]) -> BeaconOutput:
        if rollout_id == "r0":
            return BeaconOutput(status=TaskStatus.FAILED, error="coach: raised ValueError")
        # A turn it was not given, and a second beacon for turn 0: neither is used.
        return BeaconOutput(
            beacons=[
                Beacon(turn=0, feedback="use x and y."),
                Beacon(turn=0, feedback="again."),
                Beacon(turn=7, feedback="no such turn."),
            ]
        )

    c = _with_pool(tokenizer, FakeBeaconPool(answer))
    erred, other = _rollout(tokenizer, 0, ERROR, [7]), _rollout(tokenizer, 1, ERROR, [8])
    segments = _segments([erred, other])
    _, rewrites, metrics = rewritten(c, [erred, other], segments, 0)
    assert metrics["beacons/failed"] == 1.0 and metrics["beacons/unknown_turn"] == 2.0
    assert metrics["beacons/turns"] == 1.0 and len(rewrites) == 1
    # Only r1's first turn was rewritten, with the component's first feedback for it.
    feedback = USER_BEACON.format(feedback="use x and y.")
    assert c.student.prompts == [prompt_token_ids(tokenizer, with_note(segments[2].messages, feedback))]


def test_a_beacon_component_needs_beacon_rewrite_and_is_the_only_one() -> None:
    coach = {"name": "coach", "type": "beacon", "fcmodel": {"zipdir": "/w", "classpath": "b.C"}}
    with pytest.raises(ConfigError, match=r"functions\.coach: a beacon component writes the beacons of "):
        parse_job_spec(_job({}, [AGENT, coach]))
    second = {**coach, "name": "coach2"}
    hp = {"beacon_rewrite": "teacher", "turn_preference_coef": 1.0}
    with pytest.raises(ConfigError, match="at most one beacon component"):
        parse_job_spec(_job(hp, [AGENT, coach, second]))
    # With a beacon component, no agent is needed: the component decides which turns get feedback.
    assert parse_job_spec(_job(hp, [coach])).beacon_components[0].name == "coach"


# -- the outcome rule and the check of each rewrite -------------------------------------------------

EXPECTED = {"name": "add", "arguments": {"x": 2, "y": 3}}  # what the episode's reference lists


def _referenced(tokenizer: Any, index: int, reward: float, answer: dict[str, Any] = GOOD) -> RolloutResult:
    """`_rollout` whose sample's reference lists `EXPECTED` and whose reward is `reward`: its first turn
    calls add(a, b), which departs from the reference (and gets `answer`, no error by default)."""
    result = _rollout(tokenizer, index, answer, [7 + index])
    sample = Sample("train.jsonl", index, QUESTION, None, {"solution": {"tool_calls": [EXPECTED]}})
    return dataclasses.replace(result, sample=sample, reward=reward)


def _parse_json(turn: LLMCall, rewrite: LLMCall) -> Reply | None:
    """A stand-in for the model's tool-call parser: 'CALL <json>' is a call, 'BROKEN' unreadable markup,
    anything else plain text."""
    if rewrite.text == "BROKEN":
        return Reply("<tool_call>{", [], well_formed=False)
    if not rewrite.text.startswith("CALL "):
        return Reply(rewrite.text, [])
    function = json.loads(rewrite.text[len("CALL ") :])
    call = {
        "id": "r",
        "type": "function",
        "function": {**function, "arguments": json.dumps(function["arguments"])},
    }
    return Reply(None, [call])


def test_reference_progress_finds_the_first_call_that_departs() -> None:
    find = {"name": "find", "arguments": {"name": "lamp"}}
    call = {"name": "query", "arguments": {"item_id": "K-1"}}

    def calls(*replies: dict[str, Any]) -> list[LLMCall]:
        return [LLMCall([1], [2], [-1.0], response_message=r) for r in replies]

    def made(*tool_calls: dict[str, Any]) -> dict[str, Any]:
        return {
            "role": "assistant",
            "tool_calls": [{"function": {**c, "arguments": json.dumps(c["arguments"])}} for c in tool_calls],
        }

    answer = {"role": "assistant", "content": "K-1 is open"}
    assert reference_progress(calls(made(find), made(call), answer), [find, call]) == (
        [[find, call], [call], []],
        None,
    )
    # Arguments compared canonically: key order and JSON spacing do not matter.
    wrong = made({"name": "query", "arguments": {"item_id": "K-2"}})
    assert reference_progress(calls(made(find), wrong, made(call)), [find, call]) == (
        [[find, call], [call], None],
        1,
    )
    assert reference_progress(calls(answer), [find, call])[1] == 0  # a plain reply while calls are due
    assert reference_progress(calls(made(find), made(call), made(call)), [find, call])[1] == 2  # one too many


def test_a_failed_episode_gets_an_outcome_beacon_without_a_tool_error(tokenizer: Any) -> None:
    failed = _referenced(tokenizer, 0, reward=0.0)
    found = beacons_by_turn([failed], threshold=1.0)
    [beaconed] = found.values()
    assert beaconed.outcome and beaconed.turn == 0 and beaconed.due == [EXPECTED]
    assert beaconed.beacon.startswith(BEACON_HEADER)
    assert 'add({"a": 2, "b": 3})' in beaconed.beacon and 'add({"x": 2, "y": 3})' in beaconed.beacon
    assert "reward 0 < 1" in beaconed.beacon
    # A turn that got a tool error keeps the error beacon, in a failed episode too.
    erred = _referenced(tokenizer, 1, reward=0.0, answer=ERROR)
    [error_beacon] = beacons_by_turn([erred], threshold=1.0).values()
    assert not error_beacon.outcome and error_beacon.beacon == beacon_for(erred.calls[0], [ERROR])


def test_a_successful_episode_gets_no_outcome_beacon(tokenizer: Any) -> None:
    assert beacons_by_turn([_referenced(tokenizer, 0, reward=1.0)], threshold=1.0) == {}
    # Success is the job's eval_success_threshold: 0.5 is a success at 0.5, a failure at 0.75.
    assert beacons_by_turn([_referenced(tokenizer, 0, reward=0.5)], threshold=0.5) == {}
    assert len(beacons_by_turn([_referenced(tokenizer, 0, reward=0.5)], threshold=0.75)) == 1
    # No reference tool calls: nothing to depart from.
    assert beacons_by_turn([_rollout(tokenizer, 0, GOOD, [7])], threshold=1.0) == {}


def test_the_rule_verifies_rewrites_against_the_reference_and_drops_those_that_still_fail(
    tokenizer: Any,
) -> None:
    results = [_referenced(tokenizer, i, reward=0.0) for i in range(4)]
    student = FakeGroup(
        [
            ([6], 'CALL {"name": "add", "arguments": {"y": 3, "x": 2}}', "stop"),  # the reference's call
            ([5], 'CALL {"name": "add", "arguments": {"a": 3, "b": 2}}', "stop"),  # still departs
            ([4], "it is 5", "stop"),  # a plain reply while the call is due
            ([3], "BROKEN", "stop"),  # markup the parser cannot read
        ]
    )
    c = FakeJob(_spec("student"), tokenizer, FakeTeachers({}), student)
    segments = _segments(results)
    marked, rewrites, metrics = rewritten(c, results, segments, 0, parse=_parse_json)
    assert metrics["beacons/turns"] == 4.0 and metrics["beacons/outcome"] == 4.0
    assert metrics["beacons/verified"] == 1.0 and metrics["beacons/unverified"] == 3.0
    assert metrics["beacons/unverifiable"] == 0.0 and metrics["beacons/pairs"] == 1.0
    # Only the kept rewrite is a row, and it alone carries the beacon (what beacon_sft_coef trains).
    [row] = rewrites
    assert row.completion_token_ids == [6] and row.beacon.startswith(BEACON_HEADER)
    assert [s.beacon for s in marked] == [""] * len(marked)
    assert [bool(s.preference_pairs) for s in marked] == [True] + [False] * (len(marked) - 1)


def test_a_rewrite_nothing_can_check_is_kept_as_unverifiable(tokenizer: Any) -> None:
    # A tool error with no reference: the rule knows nothing due there.
    erred = _rollout(tokenizer, 0, ERROR, [7])
    student = FakeGroup([([6], 'CALL {"name": "add", "arguments": {"x": 2, "y": 3}}', "stop")])
    c = FakeJob(_spec("student"), tokenizer, FakeTeachers({}), student)
    _, rewrites, metrics = rewritten(c, [erred], _segments([erred]), 0, parse=_parse_json)
    assert (
        len(rewrites) == 1 and metrics["beacons/unverifiable"] == 1.0 and metrics["beacons/verified"] == 0.0
    )


def test_a_beacon_components_verify_decides_and_its_failure_keeps_the_rewrite(tokenizer: Any) -> None:
    def answer(rollout_id: str, turns: list[BeaconTurn]) -> BeaconOutput:
        return BeaconOutput(beacons=[Beacon(turn=0, feedback="use x and y.")])

    def verdict(call: dict[str, Any]) -> BeaconVerdict:
        return {
            "r0": BeaconVerdict(verified=True),
            "r1": BeaconVerdict(verified=False),
            "r2": BeaconVerdict(status=TaskStatus.FAILED, error="coach: raised KeyError"),
        }[call["rollout_id"]]

    pool = FakeBeaconPool(answer, verdict)
    c = _with_pool(tokenizer, pool)
    results = [_rollout(tokenizer, i, ERROR, [7 + i]) for i in range(3)]
    results[0].sample.rollout_extra["items"] = {"lamp": "K-1"}
    segments = _segments(results)
    marked, rewrites, metrics = rewritten(c, results, segments, 0, parse=_parse_json)
    assert metrics["beacons/verified"] == 1.0 and metrics["beacons/unverified"] == 1.0
    assert metrics["beacons/unverifiable"] == 1.0 and metrics["beacons/failed"] == 1.0
    assert [r.rollout_id for r in rewrites] == [0, 2] and all(r.beacon for r in rewrites)
    assert sum(bool(s.preference_pairs) for s in marked) == 2
    # What verify was given: the turn as process got it, the sample's extras, the parsed rewrite.
    first = pool.verify_calls[0]
    assert first["rollout_extra"] == {"items": {"lamp": "K-1"}} and first["feedback"].endswith(
        "use x and y. " + "Write a better reply for this point of the conversation."
    )
    assert first["turn"].turn == 0 and first["turn"].reply == REPLY and first["turn"].tool_answers == [ERROR]
    assert first["rewrite"] == {"role": "assistant", "content": "add(x=2, y=3)"}
