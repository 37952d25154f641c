"""A step's rollout keys: opened in one gateway call per model (`Gateway.open_rollouts`), each with its
rollout's seed and temperature, handed to that rollout only, and closed when it ends: by the rollout's
worker, or else by the runner, over the gateway's close route (`opd_trainer/recorded_calls.py`).

The gateways are real `Gateway` objects in real `GatewayHost`s, called in-process and served over HTTP;
a fake rollout pool stands in for the Ray workers (the real path: tests/integration).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from opd_trainer.jobspec.dataset import Sample
from opd_trainer.recorded_calls import close_keys
from opd_trainer.records import LLMCall
from opd_trainer.rollout.gateway import Gateway, RolloutKeyRequest
from opd_trainer.rollout.gateway_host import GatewayHost, GatewayRef
from opd_trainer.rollout.runner import LOST_RECORD, AuxiliaryModel, RolloutRunner
from opd_trainer.sdk import AgentOutput, RolloutOutput
from rollout_workers.pool import RolloutAnswer, RolloutRequest


class InProcessActor:
    """`actor.method.remote(...)` on a plain object, awaited like a Ray call; counts calls per method."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        method: Callable[..., Any] = getattr(self.target, name)
        calls = self.calls

        class Method:
            @staticmethod
            async def remote(*args: Any, **kwargs: Any) -> Any:
                calls[name] = calls.get(name, 0) + 1
                return method(*args, **kwargs)

        return Method


class RecordingPool:
    """Records what each rollout was given and makes one student call with its key; as a worker does,
    it closes the even rollouts' keys and returns their calls (the runner closes the others)."""

    def __init__(self, student: Gateway) -> None:
        self.student = student
        self.given: list[dict[str, Any]] = []
        self.submissions = 0

    def rollouts(self, requests: list[RolloutRequest], close_secret: str) -> list[Any]:
        self.submissions += 1
        return [self._rollout(i, request, close_secret) for i, request in enumerate(requests)]

    async def _rollout(self, index: int, request: RolloutRequest, close_secret: str) -> RolloutAnswer:
        key = request.model_resource.api_key.get_secret_value()
        session = self.student._sessions[key]
        self.given.append(
            {
                "rollout_id": request.rollout_id,
                "session_rollout_id": session.rollout_id,
                "seed": request.sampling_params["seed"],
                "session_seed": session.seed,
                "temperature": session.temperature,
                "auxiliary": {n: r.api_key.get_secret_value() for n, r in request.auxiliary_models.items()},
            }
        )
        session.calls.append(LLMCall(prompt_token_ids=[1], completion_token_ids=[2], sampler_logprobs=[-0.1]))
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
        output = RolloutOutput(agent_output=AgentOutput(messages=messages, reward_score=1.0))
        calls = None
        if index % 2 == 0:
            async with aiohttp.ClientSession() as http:
                [calls] = await close_keys(http, request.model_resource.base_url, close_secret, [key])
        return RolloutAnswer(output, [], 0, calls)


def gateway(name: str) -> Gateway:
    # These gateways never render a prompt, so they load no tokenizer and need no engine.
    return Gateway(name, "unused-tokenizer", [], max_tokens=8, temperature=1.0, max_length=64)


def hosted(name: str) -> tuple[Gateway, InProcessActor, GatewayRef]:
    """A host with one gateway answering as `name`: the gateway, the host as an actor, the runner's ref."""
    host = GatewayHost({name: "unused-tokenizer"}, max_tokens=8, temperature=1.0, max_length=64)
    actor = InProcessActor(host)
    return host._gateway(name), actor, GatewayRef(actor, name)


def test_open_rollouts_opens_one_key_per_request_in_order() -> None:
    student = gateway("student")
    keys = student.open_rollouts(
        [RolloutKeyRequest("a", 0.0, 7), RolloutKeyRequest("b"), RolloutKeyRequest("c")]
    )
    assert len(set(keys)) == 3
    sessions = [student._sessions[k] for k in keys]
    assert [s.rollout_id for s in sessions] == ["a", "b", "c"]
    assert [(s.temperature, s.seed) for s in sessions] == [(0.0, 7), (None, None), (None, None)]
    assert [student.close_rollout(k) for k in keys] == [[], [], []]
    assert student._sessions == {}


@pytest.mark.parametrize("validating", [False, True])
def test_a_step_opens_its_keys_in_one_call_per_gateway_and_closes_each(validating: bool) -> None:
    (student, student_actor, student_ref), (judge, judge_actor, judge_ref) = (
        hosted("student"),
        hosted("teacher"),
    )
    pool = RecordingPool(student)
    samples = [Sample("train.jsonl", i, [{"role": "user", "content": f"q{i}"}], None) for i in range(3)]
    seeds = [10, 11, 12, 13, 14, 15, 99]  # longer than needed: the extra seed is not used

    async def step() -> list[Any]:
        student_url, judge_url = await student.serve(), await judge.serve()
        runner = RolloutRunner(
            "job",
            student_ref,
            student_url,
            max_tokens=8,
            temperature=1.0,
            rollout_pool=pool,  # type: ignore[arg-type]
            auxiliary_models={"judge": AuxiliaryModel(judge_ref, judge_url, "teacher")},
        )
        try:
            if validating:
                return await runner.validate(samples, "v0", seeds, per_sample=2, temperature=0.5)
            return await runner.run(samples, 2, 3, seeds)
        finally:
            await runner.close()
            await student.shutdown()
            await judge.shutdown()

    results = asyncio.run(step())
    assert [r.group_id for r in results] == [0, 0, 1, 1, 2, 2]
    assert not any(r.failed for r in results) and [len(r.calls) for r in results] == [1] * 6
    # The step's rollouts go to the pool together; no Ray call closes a key (HTTP does), and each
    # gateway's close secret is asked once.
    assert pool.submissions == 1
    assert student_actor.calls == {"close_secret": 1, "open_rollouts": 1}
    assert judge_actor.calls == {"close_secret": 1, "open_rollouts": 1}
    assert student._sessions == {} and judge._sessions == {}  # every key was closed
    given = sorted(pool.given, key=lambda g: g["seed"])
    tag = "v0" if validating else "s3"
    assert [g["rollout_id"] for g in given] == [f"job-{tag}-r{i}" for i in range(6)]
    assert all(g["session_rollout_id"] == g["rollout_id"] for g in given)
    assert [g["session_seed"] for g in given] == [10, 11, 12, 13, 14, 15]
    assert {g["temperature"] for g in given} == {0.5 if validating else None}
    assert len({g["auxiliary"]["judge"] for g in given}) == 6


class AnswerLostPool(RecordingPool):
    """Each worker closed its rollout's key, but the answer that carried the record never came back;
    with `forget`, the gateway no longer holds the records either."""

    def __init__(self, student: Gateway, *, forget: bool) -> None:
        super().__init__(student)
        self.forget = forget

    async def _rollout(self, index: int, request: RolloutRequest, close_secret: str) -> RolloutAnswer:
        key = request.model_resource.api_key.get_secret_value()
        answer = await super()._rollout(0, request, close_secret)  # closes the key, as index 0 does
        assert key not in self.student._sessions
        if self.forget:
            self.student._closed.clear()
        return RolloutAnswer(answer.output, answer.spans, answer.attempt_id, None)


@pytest.mark.parametrize("forget", [False, True])
def test_a_record_whose_answer_was_lost_comes_from_the_runners_close_or_fails_its_rollout(
    forget: bool,
) -> None:
    """The runner's fallback close gets the record the worker's close took (the gateway keeps it); when
    the gateway no longer holds it, the rollout fails naming why, never trained as one without calls."""
    student, _, student_ref = hosted("student")
    pool = AnswerLostPool(student, forget=forget)
    samples = [Sample("train.jsonl", 0, [{"role": "user", "content": "q"}], None)]

    async def step() -> list[Any]:
        runner = RolloutRunner(
            "job",
            student_ref,
            await student.serve(),
            max_tokens=8,
            temperature=1.0,
            rollout_pool=pool,  # type: ignore[arg-type]
        )
        try:
            return await runner.run(samples, 2, 0, [1, 2])
        finally:
            await runner.close()
            await student.shutdown()

    results = asyncio.run(step())
    if forget:
        assert all(r.failed and r.error == LOST_RECORD and r.calls == [] for r in results)
    else:
        assert not any(r.failed for r in results) and [len(r.calls) for r in results] == [1, 1]
