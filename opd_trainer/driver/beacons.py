"""Hindsight beacons (seed 003): a turn that went wrong, written again knowing what followed it, and
trained as the preferred action for the turn's own context.

With `hyper_parameters.beacon_rewrite` ('teacher' or 'student'), after the signal phase of a step:

1. **Beacons**: with a `beacon` component (the user's `AbstractBeaconProcessor`, in its sandboxed pool),
   each finished rollout and its trained turns go to it, and the feedback it returns for a turn
   becomes that turn's beacon (`USER_BEACON`); a rollout whose call failed counts in `beacons/failed`,
   feedback for a turn that is not one of those given (or a second for one) in `beacons/unknown_turn`.
   Without one, `beacon_for`, a built-in rule: a trained turn whose tool calls got an error answer
   (`agent_eval.is_tool_error`) gets a beacon: structured, verifiable feedback from what happened after
   it ("at this point the assistant replied <its calls>; the tools answered: <the errors>"), under
   `BEACON_HEADER`. Nothing a tool did not say goes in. The rule takes the error for the turn's own
   fault (a wrong argument, a wrong tool): where a tool fails for a reason the agent could not know at
   that turn (an item that moved since), the rewrite learns to act on what only the error revealed,
   which it cannot know at inference; leave beacons off for such tasks.
2. **Rewrite**: the turn's conversation with the beacon as a system note (`teacher_hindsight.with_note`,
   its tools and template arguments) is sampled by the rewriting model, the teacher its sample is routed
   to or the student's engines: greedily, or at `beacon_temperature` with a seed per step and turn.
3. **Filter**: a rewrite equal to the turn, cut off at `max_tokens`, or carrying the beacon's (or a
   note's) wording (`carries_note_wording`: seed 003's leakage check) is dropped and counted.
4. **Pair**: the rewrite becomes a segment for the turn's *own* prompt (the beacon is nowhere in it),
   scored there by the same teacher (the DPO reference, as for mined pairs), and the chosen side of a
   preference pair whose rejected side is the turn (`learner/turn_preference.py`'s loss, weighted by
   `turn_preference_coef`). It is not distilled (`LLMCall.distilled`): its tokens are not the student's
   sample, so only the preference term reads them. A turn already chosen in a mined pair gets no beacon
   pair (it would be both chosen and rejected).

Per step: `beacons/turns` (turns with a beacon), `beacons/pairs`, `beacons/unchanged`,
`beacons/cut_off`, `beacons/leaked`, `beacons/skipped` (the turn's prompt cannot be rebuilt from its
messages, its template refuses the note, or the note leaves no room under `max_length`; or the turn is
already chosen in a pair); with a beacon component also `beacons/failed` and `beacons/unknown_turn`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import TYPE_CHECKING, Any

from opd_trainer.driver.seeds import request_seed
from opd_trainer.driver.teacher_hindsight import (
    BEACON_HEADER,
    carries_note_wording,
    noted_prompt,
    tool_answers,
)
from opd_trainer.engine.lengths import completion_room
from opd_trainer.jobspec.dataset import ground_truth_of
from opd_trainer.learner.turn_preference import CHOSEN, REJECTED
from opd_trainer.records import LLMCall
from opd_trainer.rollout.agent_eval import is_tool_error, message_text, tool_call_function
from opd_trainer.sdk import AgentOutput, BeaconTurn, TaskStatus

if TYPE_CHECKING:
    from opd_trainer.driver.components import Components
    from opd_trainer.rollout.runner import RolloutResult
    from reward_workers.beacon_pool import BeaconPool

BEACON = (
    BEACON_HEADER + " at this point the assistant replied {reply}; the tools answered: {errors}. "
    "Write a better reply for this point of the conversation."
)
USER_BEACON = BEACON_HEADER + " {feedback} Write a better reply for this point of the conversation."
COUNTS = ("turns", "pairs", "unchanged", "cut_off", "leaked", "skipped")
USER_COUNTS = ("failed", "unknown_turn")  # a beacon component's calls
REWRITE_SEED_OFFSET = 1_000_000  # rewrite seeds past any step's rollout indices (batch x n_rollouts)


def _reply_summary(call: LLMCall) -> str:
    """What the turn did: its tool calls as name(arguments), else its text."""
    named = []
    for tool_call in call.response_message.get("tool_calls") or []:
        name, arguments = tool_call_function(tool_call)
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False, sort_keys=True)
        named.append(f"{name}({arguments})")
    return ", ".join(named) if named else json.dumps(call.text, ensure_ascii=False)


def beacon_for(call: LLMCall, answers: list[dict[str, Any]]) -> str | None:
    """The beacon for one turn given the tool messages that answered it; None when none is an error."""
    errors = [message_text(m) for m in answers if is_tool_error(m)]
    if not errors:
        return None
    return BEACON.format(reply=_reply_summary(call), errors=" | ".join(errors))


Key = tuple[int, tuple[int, ...], tuple[int, ...]]


def _key(segment: LLMCall) -> Key:
    return segment.rollout_id, tuple(segment.prompt_token_ids), tuple(segment.completion_token_ids)


def _call_key(result: RolloutResult, call: LLMCall) -> Key:
    """The key of `call`'s segment (segments are copies of the calls, `step.teacher_segments`, with the
    rollout's index as their `rollout_id`)."""
    return result.index, tuple(call.prompt_token_ids), tuple(call.completion_token_ids)


def beacons_by_turn(results: list[RolloutResult]) -> dict[Key, str]:
    """Each beaconed turn of the step's successful rollouts by the built-in rule, by its segment's key."""
    found: dict[Key, str] = {}
    for result in results:
        if result.failed:
            continue
        for call, answers in zip(result.calls, tool_answers(result.calls, result.messages), strict=True):
            beacon = beacon_for(call, answers) if call.completion_token_ids else None
            if beacon is not None:
                found[_call_key(result, call)] = beacon
    return found


async def user_beacons(pool: BeaconPool, result: RolloutResult, counts: dict[str, int]) -> dict[Key, str]:
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
    turns = [
        BeaconTurn(turn=index, messages=call.messages, reply=call.response_message, tool_answers=answers)
        for index, (call, answers) in trained.items()
    ]
    output = await pool.beacons(
        sample_id=result.sample.sample_id,
        rollout_id=result.rollout_id,
        ground_truth=ground_truth_of(result.sample),
        agent_output=result.agent_output or AgentOutput(messages=result.messages),
        reward=result.reward,
        component_rewards=result.component_rewards,
        turns=turns,
    )
    if output.status == TaskStatus.FAILED:
        counts["failed"] += 1
        return {}
    found: dict[Key, str] = {}
    for beacon in output.beacons:
        call = trained[beacon.turn][0] if beacon.turn in trained else None
        if call is None or _call_key(result, call) in found:
            counts["unknown_turn"] += 1
            continue
        found[_call_key(result, call)] = USER_BEACON.format(feedback=beacon.feedback)
    return found


async def _beacons(c: Components, results: list[RolloutResult], counts: dict[str, int]) -> dict[Key, str]:
    """The step's beacons: the beacon component's, else the built-in rule's."""
    if c.beacon_pool is None:
        return beacons_by_turn(results)
    pool = c.beacon_pool
    written = await asyncio.gather(*(user_beacons(pool, r, counts) for r in results if not r.failed))
    return {key: beacon for one in written for key, beacon in one.items()}


@dataclasses.dataclass(frozen=True)
class _Turn:
    index: int  # in the step's segments
    beaconed_prompt: list[int]
    beacon: str


def _turns_to_rewrite(
    segments: list[LLMCall], beacons: dict[Key, str], tokenizer: Any, max_length: int, counts: dict[str, int]
) -> list[_Turn]:
    turns = []
    for index, segment in enumerate(segments):
        beacon = beacons.get(_key(segment))
        if beacon is None:
            continue
        counts["turns"] += 1
        prompt = noted_prompt(tokenizer, segment, beacon)
        chosen_already = any(side == CHOSEN for _, side in segment.preference_pairs)
        if not prompt or completion_room(max_length, len(prompt)) < 1 or chosen_already:
            counts["skipped"] += 1
            continue
        turns.append(_Turn(index, prompt, beacon))
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


async def _rewrite(c: Components, turns: list[_Turn], names: list[str], step: int) -> list[LLMCall]:
    """Each turn sampled on its beaconed prompt by the rewriting model (`beacon_rewrite`): the student's
    engines, or the teacher `names` routes its sample to; at `beacon_temperature`, each turn with a seed
    of its own (`seeds.request_seed`, past the step's rollouts' indices); in input order."""
    hp = c.spec.hyper_parameters
    sampling = {"max_tokens": hp.max_tokens, "temperature": hp.beacon_temperature}
    prompts = [t.beaconed_prompt for t in turns]
    seeds = [request_seed(hp.seed, step, REWRITE_SEED_OFFSET + t.index) for t in turns]
    if hp.beacon_rewrite == "student":
        return await c.student.generate_many(prompts, seeds, **sampling)
    out: list[Any] = [None] * len(turns)
    for name in dict.fromkeys(names):
        chosen = [i for i, n in enumerate(names) if n == name]
        group = c.teachers.groups[name]
        written = await group.generate_many(
            [prompts[i] for i in chosen], [seeds[i] for i in chosen], **sampling
        )
        for i, call in zip(chosen, written, strict=True):
            out[i] = call
    return out


async def rewrite_with_beacons(
    c: Components, results: list[RolloutResult], segments: list[LLMCall], step: int
) -> tuple[list[LLMCall], list[LLMCall], dict[str, float]]:
    """The step's beacon pairs (module docstring): returns `segments` with each rewritten turn marked
    rejected, the rewrites (chosen, not distilled; each in its turn's rollout, so a pair never spans
    two mini-batches) and the `beacons/*` counts."""
    hp = c.spec.hyper_parameters
    counts = dict.fromkeys(COUNTS + (USER_COUNTS if c.beacon_pool is not None else ()), 0)
    beacons = await _beacons(c, results, counts)
    turns = _turns_to_rewrite(segments, beacons, c.tokenizer, c.max_length, counts)
    if not turns:
        return segments, [], {f"beacons/{name}": float(value) for name, value in counts.items()}
    samples = {r.index: r.sample for r in results}
    names = [c.teachers.name_for(samples[segments[t.index].rollout_id]) for t in turns]
    rewrites = await _rewrite(c, turns, names, step)
    kept = [
        (turn, rewrite, name)
        for turn, rewrite, name in zip(turns, rewrites, names, strict=True)
        if _kept(segments[turn.index], rewrite, counts)
    ]
    # The reference for the pair: the teacher's logprobs of the rewrite on the turn's own prompt.
    pairs = [
        (segments[turn.index].prompt_token_ids, rewrite.completion_token_ids) for turn, rewrite, _ in kept
    ]
    scored = await c.teachers.score_top_k([name for _, _, name in kept], pairs, hp.teacher_top_k)
    next_id = 1 + max((pair for s in segments for pair, _ in s.preference_pairs), default=-1)
    marked = list(segments)
    chosen_rows: list[LLMCall] = []
    for offset, ((turn, rewrite, _), one) in enumerate(zip(kept, scored, strict=True)):
        original = marked[turn.index]
        pair_id = next_id + offset
        marked[turn.index] = dataclasses.replace(
            original, preference_pairs=(*original.preference_pairs, (pair_id, REJECTED))
        )
        chosen_rows.append(
            dataclasses.replace(
                original,
                completion_token_ids=list(rewrite.completion_token_ids),
                sampler_logprobs=list(rewrite.sampler_logprobs),
                text=rewrite.text,
                finish_reason=rewrite.finish_reason,
                response_message={},
                teacher_logprobs=one.scores.logprobs.tolist(),
                teacher_top_ids=one.scores.top_ids if hp.teacher_top_k else None,
                teacher_top_logprobs=one.scores.top_logprobs if hp.teacher_top_k else None,
                teacher_saw_note=False,
                teacher_name=one.teacher,
                teacher_latency_s=one.latency_s,
                hindsight=0.0,
                preference_pairs=((pair_id, CHOSEN),),
                distilled=False,
                beacon=turn.beacon,
            )
        )
    counts["pairs"] = len(chosen_rows)
    return marked, chosen_rows, {f"beacons/{name}": float(value) for name, value in counts.items()}
