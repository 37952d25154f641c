"""Checking beacon rewrites (`signal/beacons.py`): the beacon processor's `verify` hook, called
through the same sandboxed channel as `process`; the lookup example's beacon component on real lookup
episodes; and the leakage scan's hindsight wording against the demo tasks' own replies."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from opd_trainer.demo.tool_routing import lookup, self_correction, task
from opd_trainer.sdk import (
    PROMPT_MESSAGES_KEY,
    AbstractBeaconProcessor,
    AgentOutput,
    BeaconInput,
    BeaconOutput,
    BeaconTurn,
    BeaconVerdict,
    BeaconVerifyInput,
    TaskStatus,
    call_processor,
)
from opd_trainer.sdk.types import method_of, method_types
from opd_trainer.signal.beacons import BEACON, OUTCOME_BEACON
from opd_trainer.signal.leaks import carries_note_wording, hindsight_wording
from opd_trainer.storage.zips import pack_workspace
from opd_trainer.workers.processor_channel import SandboxedProcessor

ROOT = Path(__file__).resolve().parents[2]
TURN = BeaconTurn(turn=0, messages=[{"role": "user", "content": "hi"}], reply={"role": "assistant"})


def _verify_input(rewrite: dict[str, Any], **fields: Any) -> BeaconVerifyInput:
    return BeaconVerifyInput(
        agent_output=AgentOutput(messages=[]), turn=TURN, feedback="f", rewrite=rewrite, **fields
    )


class Says(AbstractBeaconProcessor):
    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def process(self, beacon_input: BeaconInput) -> BeaconOutput:  # type: ignore[override]
        return BeaconOutput()

    def verify(self, verify_input: BeaconVerifyInput) -> Any:  # type: ignore[override]
        return self.answer


class Default(AbstractBeaconProcessor):
    async def process(self, beacon_input: BeaconInput) -> BeaconOutput:
        return BeaconOutput()


def test_verify_is_a_second_method_whose_answer_becomes_a_verdict() -> None:
    payload = _verify_input({"role": "assistant", "content": "x"})
    assert method_of(payload) == ("verify", BeaconVerdict)
    assert method_types("beacon", "verify") == (BeaconVerifyInput, BeaconVerdict)
    assert method_types("beacon", "process") == (BeaconInput, BeaconOutput)
    with pytest.raises(KeyError):
        method_types("reward", "verify")
    for answer in (True, False, None):
        assert asyncio.run(call_processor(Says(answer), payload)) == BeaconVerdict(verified=answer)
    # The base class cannot check anything: None.
    assert asyncio.run(call_processor(Default(), payload)) == BeaconVerdict(verified=None)
    with pytest.raises(TypeError, match=r"Says\.verify returned str, expected True, False or None"):
        asyncio.run(call_processor(Says("yes"), payload))


BEACON_PROCESSOR = """
from opd_trainer.sdk import AbstractBeaconProcessor, Beacon, BeaconOutput


class Coach(AbstractBeaconProcessor):
    def process(self, beacon_input):
        return BeaconOutput(beacons=[Beacon(turn=t.turn, feedback="use x.") for t in beacon_input.turns])

    async def verify(self, verify_input):
        if verify_input.feedback == "raise":
            raise ValueError("cannot replay")
        return verify_input.rewrite.get("content") == "good"
"""


def _coach(tmp_path: Path) -> SandboxedProcessor:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "coach.py").write_text(textwrap.dedent(BEACON_PROCESSOR))
    return SandboxedProcessor(
        workspace_zip=pack_workspace(workspace),
        classpath="coach.py:Coach",
        kind="beacon",
        component="coach",
        concurrency=2,
        timeout_s=20,
        answer_grace_s=5,
        memory_mb=1024,
        scratch_mb=64,
        cpus=1,
        runtime_env={},
        requirements=[],
        mode="none",
        network="gateway",
    )


def test_verify_runs_in_the_sandboxed_processor_beside_process(tmp_path: Path) -> None:
    async def calls() -> list[Any]:
        processor = _coach(tmp_path)
        await processor.start()
        try:
            beacon_input = BeaconInput(agent_output=AgentOutput(messages=[]), reward=0.0, turns=[TURN])
            written = await processor.call(beacon_input, "r1", BeaconOutput)
            good, bad = (_verify_input({"role": "assistant", "content": c}) for c in ("good", "bad"))
            raising = _verify_input({"role": "assistant", "content": "good"}).model_copy(
                update={"feedback": "raise"}
            )
            verdicts = [
                await processor.call(payload, "r1", BeaconVerdict, "verify")
                for payload in (good, bad, raising)
            ]
            return [written["output"], *(v["output"] for v in verdicts)]
        finally:
            await processor.close()

    written, good, bad, raising = asyncio.run(calls())
    assert written.beacons[0].feedback == "use x."
    assert good == BeaconVerdict(verified=True) and bad == BeaconVerdict(verified=False)
    assert raising.status == TaskStatus.FAILED and "ValueError: cannot replay" in raising.error


# -- the lookup example's beacon component, on real lookup episodes ----------------------------------


def _lookup_beacon() -> ModuleType:
    path = ROOT / "examples" / "lookup_agentic" / "workspace" / "functions" / "beacon.py"
    spec = importlib.util.spec_from_file_location("lookup_beacon_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _call(name: str, arguments: dict[str, Any], call_id: str = "call_0") -> dict[str, Any]:
    function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


def _play(
    episode: dict[str, Any], replies: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[BeaconTurn]]:
    """The episode's conversation with the agent's `replies`, each call answered by `lookup.run_tool`,
    and its turns as a beacon component is given them."""
    messages = list(episode["messages"])
    items = episode["rollout_extra"]["items"]
    turns = []
    for index, reply in enumerate(replies):
        context = list(messages)
        messages.append(reply)
        answers = []
        for call in reply.get("tool_calls") or []:
            function = call["function"]
            result = lookup.run_tool(function["name"], json.loads(function["arguments"]), items)
            answers.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        messages += answers
        turns.append(BeaconTurn(turn=index, messages=context, reply=reply, tool_answers=answers))
    return messages, turns


def _episode() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A lookup episode with its two expected calls."""
    episode = lookup.make_episodes("train", 1, seed=3)[0]
    find, expected = json.loads(episode["rollout_extra"]["solution"])["tool_calls"]
    return episode, find, expected


def _beacon_input(episode: dict[str, Any], replies: list[dict[str, Any]]) -> BeaconInput:
    messages, turns = _play(episode, replies)
    start = len(episode["messages"])
    score = lookup.score_episode(messages, start, episode["rollout_extra"]["solution"])
    return BeaconInput(
        ground_truth=episode["rollout_extra"]["solution"],
        agent_output=AgentOutput(messages=messages, rollout_extra={PROMPT_MESSAGES_KEY: start}),
        reward=score.reward,
        turns=turns,
    )


def _answer(episode: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    result = json.loads(
        lookup.run_tool(expected["name"], expected["arguments"], episode["rollout_extra"]["items"])
    )
    named = result.get("status") or expected["arguments"].get("priority", "")
    return {"role": "assistant", "content": f"{expected['arguments']['item_id']} is {named}."}


def test_the_lookup_beacon_says_nothing_of_a_clean_episode() -> None:
    beacon = _lookup_beacon().LookupBeacon()
    episode, find, expected = _episode()
    replies = [_call(find["name"], find["arguments"]), _call(expected["name"], expected["arguments"])]
    clean = _beacon_input(episode, [*replies, _answer(episode, expected)])
    assert clean.reward == 1.0
    assert asyncio.run(beacon.process(clean)).beacons == []


def test_the_lookup_beacon_names_the_first_departure_and_verify_replays_the_rewrite() -> None:
    beacon = _lookup_beacon().LookupBeacon()
    episode, find, expected = _episode()
    other = next(
        n for n in lookup.item_names("en") + lookup.item_names("zh") if n != find["arguments"]["name"]
    )
    # A skipped lookup on a guessed id (an error), then the lookup, then a call on the right id with the
    # right tool but a plain reply too early: the episode fails (no answer naming the result).
    wrong_id = {**expected["arguments"], "item_id": "K-0000"}
    replies = [
        _call(expected["name"], wrong_id),
        _call(find["name"], find["arguments"]),
        _call(expected["name"], expected["arguments"]),
        {"role": "assistant", "content": "Done."},
    ]
    failed = _beacon_input(episode, replies)
    assert failed.reward < 0.75
    written = asyncio.run(beacon.process(failed))
    # Turn 0 got an error and is due the lookup; after it the place is unknown, so no other departure.
    [first] = written.beacons
    assert first.turn == 0 and "no item K-0000" in first.feedback and "find_item" in first.feedback
    assert hindsight_wording(first.feedback) is None  # facts only, no outcome talk

    def verify(turn: int, rewrite: dict[str, Any]) -> bool | None:
        payload = BeaconVerifyInput(
            ground_truth=failed.ground_truth,
            agent_output=failed.agent_output,
            turn=failed.turns[turn],
            feedback=first.feedback,
            rewrite=rewrite,
        )
        result: bool | None = asyncio.run(beacon.verify(payload))
        return result

    assert verify(0, _call(find["name"], find["arguments"])) is True  # the lookup, as due
    assert verify(0, _call(find["name"], {"name": other})) is False  # the backend answers an error
    assert verify(0, _call(expected["name"], expected["arguments"])) is False  # succeeds, but not due yet
    assert verify(0, {"role": "assistant", "content": "Which item?"}) is False  # a call is due
    # After the departure the place is unknown: a call of the chain that succeeds passes, text is unknown.
    assert verify(2, _call(expected["name"], expected["arguments"])) is True
    assert verify(2, {"role": "assistant", "content": "Done."}) is None

    # A failed episode without any error: the plain reply where the answer is due names neither value.
    right = [_call(find["name"], find["arguments"]), _call(expected["name"], expected["arguments"])]
    unanswered = _beacon_input(episode, [*right, {"role": "assistant", "content": "Done."}])
    assert unanswered.reward == 0.25
    [last] = asyncio.run(beacon.process(unanswered)).beacons
    assert last.turn == 2 and expected["arguments"]["item_id"] in last.feedback
    answer = _answer(episode, expected)
    payload = BeaconVerifyInput(
        ground_truth=unanswered.ground_truth,
        agent_output=unanswered.agent_output,
        turn=unanswered.turns[2],
        feedback=last.feedback,
        rewrite=answer,
    )
    assert asyncio.run(beacon.verify(payload)) is True
    assert asyncio.run(beacon.verify(payload.model_copy(update={"rewrite": replies[3]}))) is False


def test_the_lookup_example_workspace_imports_only_what_its_other_files_do() -> None:
    functions = ROOT / "examples" / "lookup_agentic" / "workspace" / "functions"

    def imported(path: Path) -> set[str]:
        return {
            line.split()[1] for line in path.read_text().splitlines() if line.startswith(("import ", "from "))
        }

    allowed = imported(functions / "rollout.py") | imported(functions / "reward.py") | {"typing"}
    assert imported(functions / "beacon.py") <= allowed


# -- the leakage scan's hindsight wording ----------------------------------------------------------


def _reply_texts(message: dict[str, Any]) -> list[str]:
    """A reply as the student's raw text would hold it: its content and each call's JSON."""
    texts = [str(message.get("content") or "")]
    for call in message.get("tool_calls") or []:
        texts.append(json.dumps(call["function"], ensure_ascii=False))
    return texts


@pytest.mark.parametrize(
    "text",
    [
        "最终结果证明该动作导致后续查询失败，因为用户需要查询的是北京。",
        "根据最终结果，这一步应该选北京。",
        "事后看，应该先调用 find_item。",
        "In hindsight, I should have called find_item first.",
        "The final result shows the id was wrong.",
        "It turned out the item K-1 does not exist.",
        "According to the final answer, the id is K-1.",
        "The episode failed because the id was guessed.",
        BEACON.format(reply="x", errors="y"),
        OUTCOME_BEACON.format(reply="x", reward=0.0, threshold=1.0, expected="y"),
    ],
)
def test_the_seeds_hindsight_wording_is_flagged(text: str) -> None:
    assert carries_note_wording(text), text


def test_the_demo_tasks_own_replies_and_tools_are_not_flagged() -> None:
    texts = [name for name in lookup.TOOL_NAMES]
    texts += lookup.item_names("en") + lookup.item_names("zh")
    for sample in lookup.make_samples("train", 200) + task.make_samples("train", 200):
        texts += _reply_texts(sample.reference_message)
        texts += [str(m.get("content") or "") for m in sample.record["messages"]]
    for episode in lookup.make_episodes("train", 50) + self_correction.make_episodes("train", 50):
        texts += [str(m.get("content") or "") for m in episode["messages"]]
    # Tool answers, errors included, as the agent reads them.
    texts += [self_correction.run_tool("query_status", {"item_id": "K-1"}, {"K-1": "K-2"})]
    texts += [lookup.run_tool("find_item", {"name": "nobody"}, {}), "The call failed; 已成功更新条目。"]
    flagged = [(t, hindsight_wording(t)) for t in texts if carries_note_wording(t)]
    assert flagged == []
    assert len(texts) > 800
