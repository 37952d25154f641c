"""Hindsight beacons: a turn that went wrong, written again knowing what followed it, and
trained as the preferred action for the turn's own context.

With `hyper_parameters.beacon_rewrite` ('teacher' or 'student'), the last shaping step of a step's signal
(`shape.shape_signal`):

1. **Beacons**: with a `beacon` component (the user's `AbstractBeaconProcessor`, in its sandboxed pool),
   each finished rollout and its trained turns go to it, and the feedback it returns for a turn
   becomes that turn's beacon (`USER_BEACON`); a rollout whose call failed counts in `beacons/failed`,
   feedback for a turn that is not one of those given (or a second for one) in `beacons/unknown_turn`.
   Without one, the built-in rule (`beacons_by_turn`), structured and verifiable feedback only (nothing
   goes in that the tools or the episode's checker did not say), under `BEACON_HEADER`:
   - **Tool errors** (`beacon_for`): a trained turn whose tool calls got an error answer
     (`agent_eval.is_tool_error`): "at this point the assistant replied <its calls>; the tools
     answered: <the errors>". The rule takes the error for the turn's own fault (a wrong argument, a
     wrong tool): where a tool fails for a reason the agent could not know at that turn (an item that
     moved since), the rewrite learns to act on what only the error revealed, which it cannot know at
     inference; leave beacons off for such tasks (or give them a component).
   - **Outcome** (`outcome_beacon`, `beacons/outcome`): in a failed episode (its evaluator score, else
     its reward, below `hyper_parameters.eval_success_threshold`, default 1.0: any episode short of full
     marks) whose sample's reference lists tool calls (`agent_eval.reference_tool_calls`), the first
     call whose action departs from them (`reference_progress`: its tool calls, by name and canonical
     arguments, are not the next ones the reference lists; or a plain reply while the reference still
     lists calls; or a call after the reference's last) gets "at this point the assistant replied <its
     calls>; the episode ended below its success threshold (reward r < t), and the reference it is
     checked against expects <the reference's next calls, or no further tool call> here", if it is a
     trained turn and has no error beacon (a tool-error turn keeps its error beacon). Limits: the
     reference is one path, so an equally good other order or repair departs from it (only failed
     episodes are beaconed, so a success never is); only tool calls are compared, so a failure in the
     final answer alone gets no outcome beacon; after the first departure the rule no longer knows
     what is due, so later turns get none; and the rule assumes the reference's next call can be
     worked out from the turn's own context (its arguments come from the request or from earlier tool
     answers), as it can in the lookup and self-correction tasks, not where the reference holds what
     only a later tool answer reveals.
2. **Rewrite**: the turn's conversation with the beacon as a system note (`notes.with_note`,
   its tools and template arguments) is sampled by the rewriting model, the teacher its sample is routed
   to or the student's engines: greedily, or at `beacon_temperature` with a seed per step and turn.
3. **Filter**: a rewrite equal to the turn, cut off at `max_tokens`, or carrying the beacon's (or a
   note's) wording or hindsight phrases (`leaks.carries_note_wording`: the leakage check) is dropped
   and counted.
4. **Verify** (only an improved action is a target): each remaining rewrite's text is parsed
   as the gateway parses the student's replies (vLLM's tool-call parser for the job's
   `tool_call_parser`, `ToolCallReplies`; plain text where the turn offers no tools). A rewrite whose
   call markup the parser cannot read, or that names a tool not offered, still fails. Otherwise, with a
   beacon component, its `verify` replays the rewrite against the episode's tools (in the same sandboxed
   pool as `process`); without one, the rule compares the rewrite's tool calls (name and canonical
   arguments) with the reference's calls still due at that turn (`rule_verdict`), which it knows up to
   the episode's first departure. Each rewrite counts in `beacons/verified` (it works: kept),
   `beacons/unverified` (it still fails: dropped) or `beacons/unverifiable` (nothing could check it, a
   plain reply the reference says nothing about, or a `verify` call that failed, counted in
   `beacons/failed` too: kept).
5. **Pair**: the rewrite becomes a segment for the turn's *own* prompt (the beacon is nowhere in it),
   scored there by the same teacher (the DPO reference, as for mined pairs), and the chosen side of a
   preference pair whose rejected side is the turn (`learner/preference_loss.py`'s loss, weighted by
   `turn_preference_coef`). It is not distilled (`LLMCall.distilled`): its tokens are not the student's
   sample, so only the preference term and, with `beacon_sft_coef`, the supervised term on rows whose
   `LLMCall.beacon` is set (exactly the kept rewrites: nothing else carries it) read them. A turn
   already chosen in a mined pair gets no beacon pair (it would be both chosen and rejected).

Per step: `beacons/turns` (turns with a beacon; each ends in exactly one of `pairs`, `unchanged`,
`cut_off`, `leaked`, `unverified`, `skipped`), `beacons/pairs`, `beacons/unchanged`, `beacons/cut_off`,
`beacons/leaked`, `beacons/unverified`, `beacons/verified` and `beacons/unverifiable` (the pairs, split
by their check), `beacons/skipped` (the turn's prompt cannot be rebuilt from its messages, its template
refuses the note, or the note leaves no room under `max_length`; or the turn is already chosen in a
pair); without a beacon component `beacons/outcome` (turns beaconed by the outcome rule); with one
`beacons/failed` and `beacons/unknown_turn`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import JsonValue

from opd_trainer.actions import canonical_tool_call, tool_call_function
from opd_trainer.engine.lengths import completion_room
from opd_trainer.jobspec.dataset import ground_truth_of
from opd_trainer.jobspec.job_spec import HyperParameters
from opd_trainer.records import CHOSEN, REJECTED, LLMCall
from opd_trainer.rollout.agent_eval import (
    is_tool_error,
    message_text,
    reference_tool_calls,
    success_by_threshold,
)
from opd_trainer.sdk import AgentOutput, BeaconOutput, BeaconTurn, BeaconVerdict, TaskStatus
from opd_trainer.seeds import request_seed
from opd_trainer.signal.leaks import carries_note_wording
from opd_trainer.signal.notes import BEACON_HEADER, noted_prompt, tool_answers
from opd_trainer.signal.scores import TeacherScoring, with_teacher_scores
from opd_trainer.signal.shaped import Shaped

if TYPE_CHECKING:
    from opd_trainer.rollout.runner import RolloutResult


class Rewriter(Protocol):
    """Models that sample the rewrites (`engine.EngineGroup`)."""

    async def generate_many(
        self, prompts: list[list[int]], seeds: list[int] | None = None, **sampling: Any
    ) -> list[LLMCall]:
        """In input order; with `seeds`, prompt i is sampled with seeds[i]."""
        ...


class RewritingTeachers(TeacherScoring, Protocol):
    """A job's teachers as scorers and as rewriters, each teacher's engines by its name
    (`driver.teachers.TeacherEngines`)."""

    @property
    def groups(self) -> Mapping[str, Rewriter]: ...


class BeaconWriter(Protocol):
    """The job's beacon component, in its sandboxed pool (`reward_workers.beacon_pool.BeaconPool`)."""

    async def beacons(
        self,
        *,
        sample_id: str,
        rollout_id: str,
        ground_truth: JsonValue,
        agent_output: AgentOutput,
        reward: float,
        component_rewards: dict[str, float],
        turns: list[BeaconTurn],
    ) -> BeaconOutput:
        """The component's beacons for one rollout's trained turns (FAILED when its call failed)."""
        ...

    async def verify(
        self,
        *,
        sample_id: str,
        rollout_id: str,
        ground_truth: JsonValue,
        rollout_extra: dict[str, Any],
        tools: list[dict[str, Any]] | None,
        agent_output: AgentOutput,
        turn: BeaconTurn,
        feedback: str,
        rewrite: dict[str, Any],
    ) -> BeaconVerdict:
        """The component's verdict on one rewrite (FAILED when its call failed)."""
        ...


@dataclasses.dataclass(frozen=True)
class BeaconModels:
    """What beacons use of a running job: the teachers and the student's engines (rewriting and
    scoring), the tokenizer (a turn's prompt rebuilt with its beacon, a rewrite parsed), `max_length`,
    the job's `tool_call_parser`, and its beacon component's pool if it has one."""

    teachers: RewritingTeachers
    student: Rewriter
    tokenizer: Any
    max_length: int
    tool_call_parser: str
    pool: BeaconWriter | None = None


BEACON = (
    BEACON_HEADER + " at this point the assistant replied {reply}; the tools answered: {errors}. "
    "Write a better reply for this point of the conversation."
)
OUTCOME_BEACON = (
    BEACON_HEADER + " at this point the assistant replied {reply}; the episode ended below its success "
    "threshold (reward {reward:g} < {threshold:g}), and the reference it is checked against expects "
    "{expected} here. Write a better reply for this point of the conversation."
)
NO_FURTHER_CALL = "no further tool call (a final answer)"
USER_BEACON = BEACON_HEADER + " {feedback} Write a better reply for this point of the conversation."
# Each beaconed turn ends in exactly one of pairs, unchanged, cut_off, leaked, unverified, skipped; the
# pairs split into verified and unverifiable.
COUNTS = ("turns", "pairs", "unchanged", "cut_off", "leaked", "unverified", "skipped")
COUNTS += ("verified", "unverifiable")
RULE_COUNTS = ("outcome",)  # the built-in rule's outcome beacons
USER_COUNTS = ("failed", "unknown_turn")  # a beacon component's calls
REWRITE_SEED_OFFSET = 1_000_000  # rewrite seeds past any step's rollout indices (batch x n_rollouts)


def _calls_summary(tool_calls: list[dict[str, Any]]) -> str:
    """Tool calls as name(arguments), arguments as canonical JSON."""
    named = []
    for tool_call in tool_calls:
        name, arguments = tool_call_function(tool_call)
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False, sort_keys=True)
        named.append(f"{name}({arguments})")
    return ", ".join(named)


def _reply_summary(call: LLMCall) -> str:
    """What the turn did: its tool calls as name(arguments), else its text."""
    tool_calls = call.response_message.get("tool_calls") or []
    return _calls_summary(tool_calls) if tool_calls else json.dumps(call.text, ensure_ascii=False)


def beacon_for(call: LLMCall, answers: list[dict[str, Any]]) -> str | None:
    """The beacon for one turn given the tool messages that answered it; None when none is an error."""
    errors = [message_text(m) for m in answers if is_tool_error(m)]
    if not errors:
        return None
    return BEACON.format(reply=_reply_summary(call), errors=" | ".join(errors))


def _departs(made: list[dict[str, Any]], due: list[dict[str, Any]]) -> bool:
    """Tool calls `made` in one turn (none: a plain reply) depart from the reference's calls still `due`."""
    if not made:
        return bool(due)  # a plain reply is the answer only once every call is made
    return [canonical_tool_call(c) for c in made] != [canonical_tool_call(c) for c in due[: len(made)]]


def reference_progress(
    calls: list[LLMCall], reference: list[dict[str, Any]]
) -> tuple[list[list[dict[str, Any]] | None], int | None]:
    """Per call of one rollout (call order), the reference's calls still due when it was made, as the
    reference lists them (None after the first call that departs from them: from there on what is due
    is unknown); and the index of that first departing call (None: none departs)."""
    due_at: list[list[dict[str, Any]] | None] = []
    position, departed = 0, None
    for index, call in enumerate(calls):
        if departed is not None:
            due_at.append(None)
            continue
        due = reference[position:]
        due_at.append(due)
        made = call.response_message.get("tool_calls") or []
        if _departs(made, due):
            departed = index
        else:
            position += len(made)
    return due_at, departed


def outcome_beacon(call: LLMCall, due: list[dict[str, Any]], reward: float, threshold: float) -> str:
    """The outcome beacon of a failed episode's first departing turn, given the reference's calls still
    due there: what the turn did and the reference's next calls (as many as the turn made, at least one)."""
    made = call.response_message.get("tool_calls") or []
    expected = _calls_summary(due[: max(1, len(made))]) if due else NO_FURTHER_CALL
    return OUTCOME_BEACON.format(
        reply=_reply_summary(call), reward=reward, threshold=threshold, expected=expected
    )


Key = tuple[int, tuple[int, ...], tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class Beaconed:
    """One beaconed turn: its beacon, where it is, and what the built-in rule knows is due there."""

    beacon: str
    result: RolloutResult
    turn: int  # its index among the rollout's LLM calls
    answers: list[dict[str, Any]]  # the tool messages that answered it
    due: list[dict[str, Any]] | None = None  # the reference's calls still due (None: unknown)
    outcome: bool = False  # written by the outcome rule


def _key(segment: LLMCall) -> Key:
    return segment.rollout_id, tuple(segment.prompt_token_ids), tuple(segment.completion_token_ids)


def _call_key(result: RolloutResult, call: LLMCall) -> Key:
    """The key of `call`'s segment (segments are copies of the calls, `scores.score_rollouts`, with the
    rollout's index as their `rollout_id`)."""
    return result.index, tuple(call.prompt_token_ids), tuple(call.completion_token_ids)


def _rule_beacons(result: RolloutResult, threshold: float) -> dict[Key, Beaconed]:
    """One rollout's beacons by the built-in rule (module docstring): error beacons, and the outcome
    beacon of a failed episode's first departing turn."""
    calls = result.calls
    answers_of = tool_answers(calls, result.messages)
    reference = reference_tool_calls(result)
    due_at, departed = (
        reference_progress(calls, reference) if reference is not None else ([None] * len(calls), None)
    )
    failed = success_by_threshold(threshold)(result) is False
    found: dict[Key, Beaconed] = {}
    for index, (call, answers) in enumerate(zip(calls, answers_of, strict=True)):
        if not call.completion_token_ids:
            continue
        beacon, outcome = beacon_for(call, answers), False
        if beacon is None and failed and index == departed:
            due = due_at[index]
            assert due is not None  # known up to and including the first departure
            beacon, outcome = outcome_beacon(call, due, result.reward, threshold), True
        if beacon is not None:
            found[_call_key(result, call)] = Beaconed(beacon, result, index, answers, due_at[index], outcome)
    return found


def beacons_by_turn(results: list[RolloutResult], threshold: float = 1.0) -> dict[Key, Beaconed]:
    """Each beaconed turn of the step's successful rollouts by the built-in rule, by its segment's key;
    `threshold`: `eval_success_threshold`, below which an episode failed."""
    found: dict[Key, Beaconed] = {}
    for result in results:
        if not result.failed:
            found.update(_rule_beacons(result, threshold))
    return found


def _beacon_turn(index: int, call: LLMCall, answers: list[dict[str, Any]]) -> BeaconTurn:
    return BeaconTurn(turn=index, messages=call.messages, reply=call.response_message, tool_answers=answers)


async def user_beacons(
    pool: BeaconWriter, result: RolloutResult, counts: dict[str, int]
) -> dict[Key, Beaconed]:
    """The beacons the job's beacon component writes for one finished rollout's trained turns, by their
    segments' keys; its failures and stray turns counted in `counts`."""
    calls = result.calls
    trained = {
        index: (call, answers)
        for index, (call, answers) in enumerate(zip(calls, tool_answers(calls, result.messages), strict=True))
        if call.completion_token_ids
    }
    if not trained:
        return {}
    output = await pool.beacons(
        sample_id=result.sample.sample_id,
        rollout_id=result.rollout_id,
        ground_truth=ground_truth_of(result.sample),
        agent_output=_agent_output(result),
        reward=result.reward,
        component_rewards=result.component_rewards,
        turns=[_beacon_turn(index, call, answers) for index, (call, answers) in trained.items()],
    )
    if output.status == TaskStatus.FAILED:
        counts["failed"] += 1
        return {}
    found: dict[Key, Beaconed] = {}
    for beacon in output.beacons:
        call, answers = trained.get(beacon.turn, (None, []))
        if call is None or _call_key(result, call) in found:
            counts["unknown_turn"] += 1
            continue
        feedback = USER_BEACON.format(feedback=beacon.feedback)
        found[_call_key(result, call)] = Beaconed(feedback, result, beacon.turn, answers)
    return found


def _agent_output(result: RolloutResult) -> AgentOutput:
    return result.agent_output or AgentOutput(messages=result.messages)


async def _beacons(
    pool: BeaconWriter | None, threshold: float, results: list[RolloutResult], counts: dict[str, int]
) -> dict[Key, Beaconed]:
    """The step's beacons: the beacon component's (`pool`), else the built-in rule's (`threshold`:
    `eval_success_threshold`)."""
    if pool is None:
        found = beacons_by_turn(results, threshold)
        counts["outcome"] = sum(b.outcome for b in found.values())
        return found
    written = await asyncio.gather(*(user_beacons(pool, r, counts) for r in results if not r.failed))
    return {key: beaconed for one in written for key, beaconed in one.items()}


@dataclasses.dataclass(frozen=True)
class _Turn:
    index: int  # in the step's segments
    beaconed_prompt: list[int]
    beaconed: Beaconed


def _turns_to_rewrite(
    segments: list[LLMCall],
    beacons: dict[Key, Beaconed],
    tokenizer: Any,
    max_length: int,
    counts: dict[str, int],
) -> list[_Turn]:
    turns = []
    for index, segment in enumerate(segments):
        beaconed = beacons.get(_key(segment))
        if beaconed is None:
            continue
        counts["turns"] += 1
        prompt = noted_prompt(tokenizer, segment, beaconed.beacon)
        chosen_already = any(side == CHOSEN for _, side in segment.preference_pairs)
        if not prompt or completion_room(max_length, len(prompt)) < 1 or chosen_already:
            counts["skipped"] += 1
            continue
        turns.append(_Turn(index, prompt, beaconed))
    return turns


def _kept(turn: LLMCall, rewrite: LLMCall, counts: dict[str, int]) -> bool:
    if rewrite.completion_token_ids == turn.completion_token_ids:
        counts["unchanged"] += 1
    elif rewrite.finish_reason == "length" or not rewrite.completion_token_ids:
        counts["cut_off"] += 1
    elif carries_note_wording(rewrite.text):
        counts["leaked"] += 1
    else:
        return True
    return False


@dataclasses.dataclass(frozen=True)
class Reply:
    """A rewrite as the gateway would have answered it: its content, its tool calls (OpenAI's shape) and
    whether it is well formed (no call markup left unread, every call naming an offered tool with a JSON
    object of arguments)."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    well_formed: bool = True

    @property
    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


ParseReply = Callable[[LLMCall, LLMCall], "Reply | None"]
"""(turn, its rewrite) -> the rewrite's reply, parsed for the turn's tools; None: it cannot be parsed."""


class ToolCallReplies:
    """Rewrites parsed as the gateway parses the student's replies: vLLM's tool-call parser for the job's
    `tool_call_parser` (`rollout/tool_calls.ToolCallParsing`), on vLLM's request for the turn's
    conversation and tools, the completion decoded as that request says (`skip_special_tokens`: hermes
    keeps its markers). A turn without tools is plain text, as the gateway answers it. The parser is
    built on the first turn with tools: an import of vLLM in the driver (~8 s, ~0.5 GB, once a job)."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self._parsing: Any = None

    def __call__(self, turn: LLMCall, rewrite: LLMCall) -> Reply | None:
        if not turn.tools:
            return Reply(rewrite.text, [])
        # Lazy: vLLM loads only for beacon jobs whose turns offer tools.
        from opd_trainer.rollout.chat_requests import InvalidRequest, chat_request
        from opd_trainer.rollout.tool_calls import ToolCallParsing

        if self._parsing is None:
            self._parsing = ToolCallParsing(self.name, self.tokenizer)
        try:
            request = self._parsing.adjust(chat_request({"messages": turn.messages, "tools": turn.tools}))
        except InvalidRequest:
            return None
        skip = bool(request.skip_special_tokens)
        text = self.tokenizer.decode(rewrite.completion_token_ids, skip_special_tokens=skip)
        content, tool_calls = self._parsing.parse(text, request)
        return Reply(content, tool_calls, self._parsing.well_formed(content, tool_calls, request))


def rule_verdict(reply: Reply, due: list[dict[str, Any]] | None) -> bool | None:
    """The built-in rule's check of a rewrite against the reference's calls still `due` at its turn:
    True when its tool calls are the next ones due (name and canonical arguments, in order), False when
    they are not, or when it replies in plain text while calls are due; None when nothing is known to
    be due there, or it answers in plain text once every call is made (the reference says nothing of
    the text)."""
    if due is None or (not reply.tool_calls and not due):
        return None
    return not _departs(reply.tool_calls, due)


async def _verdict(
    pool: BeaconWriter | None, turn: _Turn, reply: Reply | None, counts: dict[str, int]
) -> bool | None:
    """Whether one rewrite works: malformed is False; else the component's `verify`, or the rule's."""
    if reply is None:
        return None
    if not reply.well_formed:
        return False
    if pool is None:
        return rule_verdict(reply, turn.beaconed.due)
    beaconed, result = turn.beaconed, turn.beaconed.result
    call = result.calls[beaconed.turn]
    verdict = await pool.verify(
        sample_id=result.sample.sample_id,
        rollout_id=result.rollout_id,
        ground_truth=ground_truth_of(result.sample),
        rollout_extra=result.sample.rollout_extra,
        tools=call.tools,
        agent_output=_agent_output(result),
        turn=_beacon_turn(beaconed.turn, call, beaconed.answers),
        feedback=beaconed.beacon,
        rewrite=reply.message,
    )
    if verdict.status == TaskStatus.FAILED:
        counts["failed"] += 1
        return None
    return verdict.verified


async def _verified(
    pool: BeaconWriter | None,
    segments: list[LLMCall],
    candidates: list[tuple[_Turn, LLMCall, str]],
    parse: ParseReply,
    counts: dict[str, int],
) -> list[tuple[_Turn, LLMCall, str]]:
    """The rewrites that pass their check (`_verdict`) or cannot be checked; each counted."""
    if not candidates:
        return []

    def parse_all() -> list[Reply | None]:
        return [parse(segments[turn.index], rewrite) for turn, rewrite, _ in candidates]

    replies = await asyncio.to_thread(parse_all)  # the first may import vLLM
    verdicts = await asyncio.gather(
        *(
            _verdict(pool, turn, reply, counts)
            for (turn, _, _), reply in zip(candidates, replies, strict=True)
        )
    )
    kept = []
    for candidate, verdict in zip(candidates, verdicts, strict=True):
        counts[{True: "verified", False: "unverified", None: "unverifiable"}[verdict]] += 1
        if verdict is not False:
            kept.append(candidate)
    return kept


async def _rewrite(
    models: BeaconModels, hp: HyperParameters, turns: list[_Turn], names: list[str], step: int
) -> list[LLMCall]:
    """Each turn sampled on its beaconed prompt by the rewriting model (`beacon_rewrite`): the student's
    engines, or the teacher `names` routes its sample to; at `beacon_temperature`, each turn with a seed
    of its own (`seeds.request_seed`, past the step's rollouts' indices); in input order."""
    sampling = {"max_tokens": hp.max_tokens, "temperature": hp.beacon_temperature}
    prompts = [t.beaconed_prompt for t in turns]
    seeds = [request_seed(hp.seed, step, REWRITE_SEED_OFFSET + t.index) for t in turns]
    if hp.beacon_rewrite == "student":
        return await models.student.generate_many(prompts, seeds, **sampling)
    out: list[Any] = [None] * len(turns)
    for name in dict.fromkeys(names):
        chosen = [i for i, n in enumerate(names) if n == name]
        group = models.teachers.groups[name]
        written = await group.generate_many(
            [prompts[i] for i in chosen], [seeds[i] for i in chosen], **sampling
        )
        for i, call in zip(chosen, written, strict=True):
            out[i] = call
    return out


async def rewrite_with_beacons(
    models: BeaconModels,
    hp: HyperParameters,
    results: list[RolloutResult],
    segments: list[LLMCall],
    step: int,
    parse: ParseReply | None = None,
) -> Shaped:
    """The step's beacon pairs (module docstring): `segments` with each rewritten turn marked rejected,
    the rewrites (chosen, not distilled, `beacon` set; each in its turn's rollout, so a pair never spans
    two mini-batches) and the `beacons/*` counts. `parse`: how a rewrite's text becomes a reply (default
    `ToolCallReplies` for the job's `tool_call_parser`)."""
    extra = USER_COUNTS if models.pool is not None else RULE_COUNTS
    counts = dict.fromkeys(COUNTS + extra, 0)
    beacons = await _beacons(models.pool, hp.eval_success_threshold, results, counts)
    turns = _turns_to_rewrite(segments, beacons, models.tokenizer, models.max_length, counts)
    if not turns:
        return Shaped(segments, {f"beacons/{name}": float(value) for name, value in counts.items()})
    samples = {r.index: r.sample for r in results}
    names = [models.teachers.name_for(samples[segments[t.index].rollout_id]) for t in turns]
    rewrites = await _rewrite(models, hp, turns, names, step)
    candidates = [
        (turn, rewrite, name)
        for turn, rewrite, name in zip(turns, rewrites, names, strict=True)
        if _kept(segments[turn.index], rewrite, counts)
    ]
    parse = parse or ToolCallReplies(models.tool_call_parser, models.tokenizer)
    kept = await _verified(models.pool, segments, candidates, parse, counts)
    # The reference for the pair: the teacher's logprobs of the rewrite on the turn's own prompt.
    pairs = [
        (segments[turn.index].prompt_token_ids, rewrite.completion_token_ids) for turn, rewrite, _ in kept
    ]
    scored = await models.teachers.score_top_k([name for _, _, name in kept], pairs, hp.teacher_top_k)
    next_id = 1 + max((pair for s in segments for pair, _ in s.preference_pairs), default=-1)
    marked = list(segments)
    chosen_rows: list[LLMCall] = []
    for offset, ((turn, rewrite, _), one) in enumerate(zip(kept, scored, strict=True)):
        original = marked[turn.index]
        pair_id = next_id + offset
        marked[turn.index] = dataclasses.replace(
            original, preference_pairs=(*original.preference_pairs, (pair_id, REJECTED))
        )
        chosen = dataclasses.replace(
            original,
            completion_token_ids=list(rewrite.completion_token_ids),
            sampler_logprobs=list(rewrite.sampler_logprobs),
            text=rewrite.text,
            finish_reason=rewrite.finish_reason,
            response_message={},
            hindsight=0.0,
            preference_pairs=((pair_id, CHOSEN),),
            distilled=False,
            beacon=turn.beaconed.beacon,
        )
        chosen_rows.append(with_teacher_scores(chosen, one, hp.teacher_top_k))
    counts["pairs"] = len(chosen_rows)
    metrics = {f"beacons/{name}": float(value) for name, value in counts.items()}
    return Shaped(marked, metrics, chosen_rows)
