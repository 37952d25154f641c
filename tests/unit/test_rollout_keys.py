"""A step's rollout keys: opened in one gateway call per model (`Gateway.open_rollouts`), each with its
rollout's seed and temperature, handed to that rollout only, and closed when it ends.

The gateways are real `Gateway` objects in real `GatewayHost`s, called in-process; a fake rollout pool
stands in for the Ray workers (the real path: tests/integration).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from chatml_tokenizer import save_chatml_tokenizer

from opd_trainer.engine import vllm_engine
from opd_trainer.engine.vllm_engine import EngineConfig
from opd_trainer.jobspec.dataset import Sample
from opd_trainer.records import LLMCall
from opd_trainer.rollout import gateway_host
from opd_trainer.rollout.gateway import Gateway, RolloutKeyRequest
from opd_trainer.rollout.gateway_host import EngineWithGateways, GatewayHost, GatewayRef
from opd_trainer.rollout.runner import AuxiliaryModel, RolloutRunner
from opd_trainer.sdk import AgentOutput, ModelResource, RolloutOutput


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
    """Records what each rollout was given and makes one student call with its key."""

    def __init__(self, student: Gateway) -> None:
        self.student = student
        self.given: list[dict[str, Any]] = []

    async def rollout(
        self,
        *,
        rollout_id: str,
        sampling_params: dict[str, Any],
        model_resource: ModelResource,
        auxiliary_models: dict[str, ModelResource],
        **_: Any,
    ) -> tuple[RolloutOutput, list[Any], int]:
        key = model_resource.api_key.get_secret_value()
        session = self.student._sessions[key]
        self.given.append(
            {
                "rollout_id": rollout_id,
                "session_rollout_id": session.rollout_id,
                "seed": sampling_params["seed"],
                "session_seed": session.seed,
                "temperature": session.temperature,
                "auxiliary": {n: r.api_key.get_secret_value() for n, r in auxiliary_models.items()},
            }
        )
        session.calls.append(LLMCall(prompt_token_ids=[1], completion_token_ids=[2], sampler_logprobs=[-0.1]))
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
        return RolloutOutput(agent_output=AgentOutput(messages=messages, reward_score=1.0)), [], 0


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
    runner = RolloutRunner(
        "job",
        student_ref,
        "http://student/v1",
        max_tokens=8,
        temperature=1.0,
        rollout_pool=pool,  # type: ignore[arg-type]
        auxiliary_models={"judge": AuxiliaryModel(judge_ref, "http://teacher/v1", "teacher")},
    )
    samples = [Sample("train.jsonl", i, [{"role": "user", "content": f"q{i}"}], None) for i in range(3)]
    seeds = [10, 11, 12, 13, 14, 15, 99]  # longer than needed: the extra seed is not used
    if validating:
        results = asyncio.run(runner.validate(samples, "v0", seeds, per_sample=2, temperature=0.5))
    else:
        results = asyncio.run(runner.run(samples, 2, 3, seeds))

    assert [r.group_id for r in results] == [0, 0, 1, 1, 2, 2]
    assert not any(r.failed for r in results) and [len(r.calls) for r in results] == [1] * 6
    # The six rollouts end in the same loop turn: their keys close in one call per gateway.
    assert student_actor.calls == {"open_rollouts": 1, "close_rollouts": 1}
    assert judge_actor.calls == {"open_rollouts": 1, "close_rollouts": 1}
    assert student._sessions == {} and judge._sessions == {}  # every key was closed
    given = sorted(pool.given, key=lambda g: g["seed"])
    tag = "v0" if validating else "s3"
    assert [g["rollout_id"] for g in given] == [f"job-{tag}-r{i}" for i in range(6)]
    assert all(g["session_rollout_id"] == g["rollout_id"] for g in given)
    assert [g["session_seed"] for g in given] == [10, 11, 12, 13, 14, 15]
    assert {g["temperature"] for g in given} == {0.5 if validating else None}
    assert len({g["auxiliary"]["judge"] for g in given}) == 6


def test_an_engine_hosts_gateways_in_its_own_process_and_stops_them_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`EngineWithGateways`: the job's gateways on a teacher engine's event loop (no engine started
    here: hosting needs none). Metered once, as the engine's process; a second gateway of a name is
    refused; shutdown stops the gateways' servers, then the engine."""
    engine = EngineWithGateways(EngineConfig(model="unused", role="teacher"), "teacher-0")
    options = {"max_tokens": 8, "temperature": 1.0, "max_length": 64}
    tokenizer = str(save_chatml_tokenizer(tmp_path))
    asyncio.run(engine.host_gateways({"student": tokenizer, "teacher": tokenizer}, **options))
    keys = engine.open_rollouts("student", [RolloutKeyRequest("a")])
    assert engine.close_rollouts("student", keys[:1]) == [[]]
    with pytest.raises(ValueError, match="already here"):
        asyncio.run(engine.host_gateways({"teacher": tokenizer}, **options))
    with pytest.raises(ValueError, match="no gateway for 'judge'"):
        engine.open_rollouts("judge", [])
    # Metered once: the engine's usage (its tokens and its process), not the gateway host's as well.
    monkeypatch.setattr(vllm_engine, "actor_usage", lambda: {"cpu_s": 7.0, "gpus": 0.0})
    monkeypatch.setattr(gateway_host, "actor_usage", lambda: {"cpu_s": 99.0, "gpus": 0.0})
    usage = asyncio.run(engine.usage())
    assert usage["cpu_s"] == 7.0 and "prompt_tokens" in usage
    stopped: list[str] = []
    for name in ("student", "teacher"):
        hosted_gateway = engine._gateway(name)
        real_shutdown = hosted_gateway.shutdown

        async def shutdown(name: str = name, real: Any = real_shutdown) -> None:
            stopped.append(name)
            await real()

        hosted_gateway.shutdown = shutdown  # type: ignore[method-assign]
    asyncio.run(engine.shutdown())
    assert stopped == ["student", "teacher"]


def test_keys_closed_together_go_in_one_call_and_each_caller_gets_its_own_calls() -> None:
    student, actor, ref = hosted("student")
    keys = student.open_rollouts([RolloutKeyRequest(f"r{i}") for i in range(4)])
    for i, key in enumerate(keys):
        student._sessions[key].calls.append(
            LLMCall(prompt_token_ids=[i], completion_token_ids=[i], sampler_logprobs=[0.0])
        )

    async def close_all() -> list[list[LLMCall]]:
        together = await asyncio.gather(*(ref.close_rollout(k) for k in keys[:3]))
        later = await ref.close_rollout(keys[3])  # after the first batch: a call of its own
        return [*together, later]

    closed = asyncio.run(close_all())
    assert [[c.prompt_token_ids for c in calls] for calls in closed] == [[[0]], [[1]], [[2]], [[3]]]
    assert actor.calls == {"close_rollouts": 2}
    assert student._sessions == {}
    # The same ref from a new event loop (a second `asyncio.run`) closes as before.
    assert asyncio.run(ref.close_rollout(keys[0])) == []


def test_a_failed_close_call_reaches_every_caller_of_its_batch() -> None:
    class Broken:
        class close_rollouts:  # stands in for a Ray actor method
            @staticmethod
            async def remote(*_: Any) -> Any:
                raise ConnectionError("gateway host died")

    ref = GatewayRef(Broken(), "student")

    async def close_two() -> list[Any]:
        return await asyncio.gather(ref.close_rollout("a"), ref.close_rollout("b"), return_exceptions=True)

    errors = asyncio.run(close_two())
    assert [type(e) for e in errors] == [ConnectionError, ConnectionError]
