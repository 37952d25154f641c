"""Lookup beacons (seed 003's hindsight beacons, written by rule from what the episode's judge knows) and
the check of each rewrite against the episode's own tool backend.

The episode's chain (its `solution`): `find_item` on the item the user named, the expected call on the
id that returns, then a plain-text answer naming the id and the result (`lookup.score_episode`).

`process` gives feedback, stating only what the tools or the chain say:
- a turn whose call got an error: what it called and what the tool answered, and the call due there
  when the turn's place in the chain is known (every earlier call was the chain's, in order);
- in an episode that did not succeed, the first turn that departs from the chain (another call, or a
  plain reply while a call is due; or, once both calls are made, a reply that does not name the id and
  the result): what it did and what the chain expects there.

`verify` replays a rewrite's tool calls with `lookup.run_tool` on the episode's item: a call the backend
answers with an error still fails, and so does a call that is not the chain's (where the turn's place is
known: not the call due there). A plain-text rewrite passes where the answer is due and it names the id
and the result, fails where a call is due, and cannot be checked after an earlier departure (None).
"""

from __future__ import annotations

import json
from typing import Any

from opd_trainer.demo.tool_routing.lookup import run_tool, score_episode
from opd_trainer.sdk import (
    PROMPT_MESSAGES_KEY,
    AbstractBeaconProcessor,
    Beacon,
    BeaconInput,
    BeaconOutput,
    BeaconVerifyInput,
    TaskStatus,
)


def _chain(ground_truth: Any) -> list[dict[str, Any]]:
    """The episode's expected calls, `{name, arguments}` each: the lookup, then the call on its id."""
    solution = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    return list(solution["tool_calls"])


def _items(chain: list[dict[str, Any]]) -> dict[str, str]:
    """The tool backend's items (name -> id), as the rollout has them: the named item and its id."""
    lookup, expected = chain
    return {lookup["arguments"]["name"]: expected["arguments"]["item_id"]}


def _calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant message's tool calls as `{name, arguments}` (arguments decoded; undecodable: {})."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = {}
        calls.append({"name": function.get("name", ""), "arguments": arguments})
    return calls


def _shown(calls: list[dict[str, Any]]) -> str:
    return ", ".join(
        f"{c['name']}({json.dumps(c['arguments'], ensure_ascii=False, sort_keys=True)})" for c in calls
    )


def _result_named(chain: list[dict[str, Any]]) -> list[str]:
    """What the answer must name: the id and the result (the status, or the new priority)."""
    expected = chain[1]
    result = json.loads(run_tool(expected["name"], expected["arguments"], _items(chain)))
    return [
        expected["arguments"]["item_id"],
        str(result.get("status") or expected["arguments"].get("priority", "")),
    ]


def _answers(text: str, chain: list[dict[str, Any]]) -> bool:
    return all(value in text for value in _result_named(chain))


def _place(history: list[dict[str, Any]], chain: list[dict[str, Any]]) -> int | None:
    """How many of the chain's calls the agent's calls in `history` made, in order; None when one of
    them departs from the chain (its place is then unknown)."""
    made = [call for message in history if message.get("role") == "assistant" for call in _calls(message)]
    return len(made) if made == chain[: len(made)] else None


def _errors(answers: list[dict[str, Any]]) -> list[str]:
    found = []
    for answer in answers:
        try:
            content = json.loads(answer.get("content") or "")
        except (TypeError, json.JSONDecodeError):
            continue
        if isinstance(content, dict) and "error" in content:
            found.append(str(content["error"]))
    return found


def _feedback(
    reply: dict[str, Any], errors: list[str], place: int | None, chain: list[dict[str, Any]], succeeded: bool
) -> str:
    """One turn's feedback ("": none), from its reply, the errors its calls got and its place in the
    chain (None: unknown)."""
    made = _calls(reply)
    did = f"called {_shown(made)}" if made else "replied in plain text"
    due = f"the call due here is {_shown([chain[place]])}" if place is not None and place < 2 else ""
    if errors:
        return f"This turn {did}; the tool answered: {' | '.join(errors)}." + (f" {due}." if due else "")
    if succeeded or place is None:
        return ""
    if place < 2 and (not made or made != chain[place : place + len(made)]):
        return f"This turn {did}; {due}."
    if place == 2 and made:
        return f"This turn {did}; both calls were already made and the answer is due here."
    if place == 2 and not _answers(str(reply.get("content") or ""), chain):
        named = " and ".join(_result_named(chain))
        return f"This turn's answer must name the item id and the result: {named}."
    return ""


class LookupBeacon(AbstractBeaconProcessor):
    async def process(self, beacon_input: BeaconInput) -> BeaconOutput:
        if beacon_input.ground_truth is None:
            return BeaconOutput(status=TaskStatus.FAILED, error="no ground truth")
        chain = _chain(beacon_input.ground_truth)
        output = beacon_input.agent_output
        start = int(output.rollout_extra.get(PROMPT_MESSAGES_KEY, 0))
        succeeded = score_episode(output.messages, start, beacon_input.ground_truth).success
        beacons: list[Beacon] = []
        for turn in beacon_input.turns:
            # Known up to the first departure: a later turn's history holds the departing call.
            place = _place(turn.messages[start:], chain)
            feedback = _feedback(turn.reply, _errors(turn.tool_answers), place, chain, succeeded)
            if feedback:
                beacons.append(Beacon(turn=turn.turn, feedback=feedback))
        return BeaconOutput(beacons=beacons)

    async def verify(self, verify_input: BeaconVerifyInput) -> bool | None:
        if verify_input.ground_truth is None:
            return None
        chain = _chain(verify_input.ground_truth)
        start = int(verify_input.agent_output.rollout_extra.get(PROMPT_MESSAGES_KEY, 0))
        place = _place(verify_input.turn.messages[start:], chain)
        made = _calls(verify_input.rewrite)
        if not made:
            if place is None:
                return None
            return place == 2 and _answers(str(verify_input.rewrite.get("content") or ""), chain)
        items = _items(chain)
        for call in made:
            arguments = call["arguments"] if isinstance(call["arguments"], dict) else {}
            if "error" in json.loads(run_tool(call["name"], arguments, items)):
                return False
        if place is None:
            return all(call in chain for call in made)
        return made == chain[place : place + len(made)]
