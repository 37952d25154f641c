"""The teacher's view of each trained token in the trajectory log (`rollout/trajectory_view.py`:
`scored_trajectories`, `call_tokens`; `driver/step.py`: `train_step` records the first trajectories
once the step's segments are scored). A fake tokenizer and hand-made segments; no Ray, no engines."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from opd_trainer.driver.step import Batch, StepClock, collect_rollouts, train_step
from opd_trainer.errors import OPDError
from opd_trainer.jobspec.dataset import Sample
from opd_trainer.jobspec.job_spec import parse_job_spec
from opd_trainer.records import LLMCall
from opd_trainer.rollout.runner import RolloutResult
from opd_trainer.rollout.trajectory_view import call_tokens, scored_trajectories
from opd_trainer.storage.run_dir import RunDir


class FakeTokenizer:
    """Decodes id N as `tN`, counting the calls."""

    def __init__(self) -> None:
        self.decoded: list[list[int]] = []

    def decode(self, token_ids: list[int]) -> str:
        self.decoded.append(list(token_ids))
        return "".join(f"t{i}" for i in token_ids)


def _call(prompt: list[int], completion: list[int], sampler: list[float], version: int = 0) -> LLMCall:
    return LLMCall(prompt, completion, sampler, weight_version=version)


def _result(index: int, calls: list[LLMCall], error: str = "") -> RolloutResult:
    sample = Sample("train.jsonl", index, [{"role": "user", "content": "hi"}], None)
    return RolloutResult(0, index, f"r{index}", sample, calls=calls, error=error, reward=0.5)


def _scored(call: LLMCall, rollout: int, teacher: list[float], top: tuple[Any, Any] | None = None) -> LLMCall:
    """The segment `score_rollouts` makes of `call` (a copy with the teacher's scores)."""
    top_ids, top_logprobs = top if top is not None else (None, None)
    return dataclasses.replace(
        call,
        teacher_logprobs=teacher,
        rollout_id=rollout,
        teacher_top_ids=top_ids,
        teacher_top_logprobs=top_logprobs,
    )


def test_a_scored_call_gets_text_log_ratio_and_the_teachers_top1_with_its_probability() -> None:
    call = _call([1, 2], [7, 8], [-0.5, -2.0])
    top_ids = np.array([[9, 7], [8, 3]], dtype=np.int32)
    top_logprobs = np.log(np.array([[0.2, 0.7], [0.6, 0.3]], dtype=np.float32))  # top-1 not in column 0
    segment = _scored(call, 0, [-0.25, -3.0], (top_ids, top_logprobs))
    view = call_tokens(segment, {7: "t7", 8: "t8", 9: "t9", 3: "t3"})
    assert view["text"] == ["t7", "t8"]
    assert view["log_ratio"] == [-0.25, 1.0]
    assert view["teacher_top"] == ["t7", "t8"]
    assert view["teacher_top_p"] == pytest.approx([0.7, 0.6], abs=1e-4)
    without_top_k = call_tokens(_scored(call, 0, [-0.25, -3.0]), {7: "t7", 8: "t8"})
    assert set(without_top_k) == {"text", "log_ratio"}


def test_trajectories_join_segments_by_rollout_and_call_order_and_leave_untrained_calls_empty() -> None:
    first, dropped, no_completion = (
        _call([1], [5, 6], [-1.0, -1.0]),
        _call([1, 5, 6, 2], [6], [-0.5]),
        _call([3], [], []),
    )
    failed_call = _call([4], [5], [-0.1])
    results = [_result(0, [first, dropped, no_completion]), _result(1, [failed_call], error="boom")]
    other_rollout = _scored(_call([9], [9], [-1.0]), 2, [-1.0])
    # `dropped` was scored but its segment is not among the trained ones (staleness).
    segments = [_scored(first, 0, [-1.5, -0.5]), other_rollout]
    tokenizer = FakeTokenizer()
    records = scored_trajectories(results, segments, tokenizer, step=3)
    calls = records[0]["llm_calls"]
    assert calls[0]["tokens"] == {"text": ["t5", "t6"], "log_ratio": [0.5, -0.5]}
    assert calls[1]["tokens"] is None and calls[2]["tokens"] is None
    assert records[0]["divergence"] == pytest.approx(0.0) and records[0]["step"] == 3
    assert records[1]["failed"] and records[1]["llm_calls"][0]["tokens"] is None
    assert records[1]["divergence"] is None
    assert sorted(ids[0] for ids in tokenizer.decoded) == [5, 6]  # each distinct id decoded once
    json.dumps(records, allow_nan=False)  # plain JSON: what trajectories.jsonl holds


def test_a_rollout_with_two_identical_prompts_matches_each_call_to_its_own_segment() -> None:
    calls = [_call([1], [2], [-1.0]), _call([1], [3], [-1.0])]
    segments = [_scored(calls[0], 0, [-2.0]), _scored(calls[1], 0, [-0.5])]
    record = scored_trajectories([_result(0, calls)], segments, FakeTokenizer(), step=1)[0]
    assert [c["tokens"]["log_ratio"] for c in record["llm_calls"]] == [[1.0], [-0.5]]
    assert record["divergence"] == pytest.approx(0.25)


def test_a_non_finite_log_ratio_is_kept_but_left_out_of_the_divergence() -> None:
    call = _call([1], [2, 3], [-1.0, -1.0])
    record = scored_trajectories(
        [_result(0, [call])], [_scored(call, 0, [-math.inf, -0.5])], FakeTokenizer(), step=1
    )[0]
    assert record["llm_calls"][0]["tokens"]["log_ratio"][0] == math.inf
    assert record["divergence"] == pytest.approx(-0.5)


# -- the step records them once scored ------------------------------------------------------------


def _hp_spec(**hyper_parameters: Any) -> Any:
    spec = {"job_name": "j", "model": "s", "teacher_model": "t", "training_datasets": ["t.jsonl"]}
    return parse_job_spec({**spec, "hyper_parameters": hyper_parameters})


def _done(value: Any) -> asyncio.Future[Any]:
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


def _components(spec: Any, tokenizer: FakeTokenizer) -> Any:
    async def learn(batches: list[list[LLMCall]]) -> dict[str, float]:
        return {"loss": 0.0}

    async def publish(version: int) -> int:
        return 0  # bytes handed to the engines

    async def engine_metrics() -> dict[str, float]:
        return {}

    return SimpleNamespace(
        spec=spec,
        tokenizer=tokenizer,
        learner=SimpleNamespace(train_step=learn),
        publish_weights=publish,
        engine_metrics=engine_metrics,
        pools=(),
        teachers=SimpleNamespace(several=False),
    )


def test_train_step_records_the_kept_trajectories_with_the_trained_segments_tokens(tmp_path: Path) -> None:
    fresh, stale = _call([1], [5], [-1.0], version=5), _call([1], [6], [-1.0], version=2)
    results = [_result(i, [fresh if i == 0 else stale]) for i in range(20)]
    segments = [_scored(fresh, 0, [-3.0]), *(_scored(stale, i, [-1.0]) for i in range(1, 20))]
    log = RunDir(tmp_path)

    async def run() -> None:
        batch = Batch(5, {}, _done(results), _done(segments))  # type: ignore[arg-type]
        sampler = SimpleNamespace(take=lambda step: batch, ahead=[], sample_ahead=lambda after, last: None)
        c = _components(_hp_spec(max_staleness=1, batch_size=1, n_rollouts=1), FakeTokenizer())
        await train_step(c, sampler, 5, sample_ahead_to=5, clock=StepClock(), log=log)  # type: ignore[arg-type]

    asyncio.run(run())
    records = log.step_trajectories(6)
    assert len(records) == 16  # the first 16 of the step's 20
    assert records[0]["llm_calls"][0]["tokens"] == {"text": ["t5"], "log_ratio": [2.0]}
    assert records[0]["divergence"] == 2.0
    assert all(r["llm_calls"][0]["tokens"] is None for r in records[1:])  # dropped as stale (lag 3 > 1)


def test_a_step_with_too_many_failed_rollouts_still_records_them_without_tokens(tmp_path: Path) -> None:
    results = [_result(i, [_call([1], [2], [-1.0])], error="tool crashed") for i in range(3)]
    log = RunDir(tmp_path)

    async def run() -> None:
        batch = Batch(5, {}, _done(results), _done([]))  # type: ignore[arg-type]
        await collect_rollouts(batch, 0, _hp_spec().hyper_parameters, has_rewards=False, log=log)

    with pytest.raises(OPDError, match="3/3 rollouts failed"):
        asyncio.run(run())
    records = log.step_trajectories(1)
    assert [r["failed"] for r in records] == [True] * 3
    assert [r["llm_calls"][0]["tokens"] for r in records] == [None] * 3


def test_a_turn_shows_its_hindsight_preference_and_note_beside_its_tokens() -> None:
    scored = _scored(_call([1], [7], [-0.5]), rollout=0, teacher=[-1.0])
    texts = {7: "t7"}
    assert "signal" not in call_tokens(scored, texts)  # distillation only: nothing beside it
    signalled = dataclasses.replace(
        scored, hindsight=-0.5, preference_pairs=((0, 1), (3, -1)), teacher_saw_note=True
    )
    assert call_tokens(signalled, texts)["signal"] == {
        "hindsight": -0.5,
        "preference": ["chosen", "rejected"],
        "teacher_saw_note": True,
    }
    assert call_tokens(dataclasses.replace(scored, hindsight=1.0), texts)["signal"] == {"hindsight": 1.0}


def test_a_step_left_with_nothing_to_train_fails_saying_what_was_dropped(tmp_path: Path) -> None:
    stale = _call([1], [6], [-1.0], version=1)
    results = [_result(i, [stale]) for i in range(2)]

    async def run() -> None:
        batch = Batch(5, {}, _done(results), _done([_scored(stale, i, [-1.0]) for i in range(2)]))  # type: ignore[arg-type]
        sampler = SimpleNamespace(take=lambda step: batch, ahead=[], sample_ahead=lambda after, last: None)
        c = _components(_hp_spec(max_staleness=1, batch_size=1, n_rollouts=2), FakeTokenizer())
        await train_step(c, sampler, 5, sample_ahead_to=5, clock=StepClock(), log=RunDir(tmp_path))  # type: ignore[arg-type]

    with pytest.raises(
        OPDError, match=r"step 6: no segment left to train.*'staleness/dropped_segments': 2.0"
    ):
        asyncio.run(run())


def test_a_turn_a_beacons_rewrite_is_preferred_over_shows_the_rewrite_and_its_beacon() -> None:
    scored = _scored(_call([1], [7], [-0.5]), rollout=0, teacher=[-1.0])
    rejected = dataclasses.replace(scored, preference_pairs=((0, -1), (4, -1)))
    rewrite = dataclasses.replace(
        scored, completion_token_ids=[8], text="better", preference_pairs=((4, 1),), beacon="B: moved"
    )
    mined_chosen = dataclasses.replace(scored, preference_pairs=((0, 1),))  # a mined pair's, no beacon
    by_pair = {4: rewrite}
    signal = call_tokens(rejected, {7: "t7"}, by_pair)["signal"]
    assert signal == {
        "preference": ["rejected", "rejected"],
        "rewrite": {"text": "better", "beacon": "B: moved"},
    }
    assert "rewrite" not in call_tokens(mined_chosen, {7: "t7"}, by_pair)["signal"]
    # Through scored_trajectories: the step's rewrites are joined by their pair to the turn they beat.
    result = RolloutResult(0, 0, "r0", Sample("d.jsonl", 0, [], None), calls=[scored])
    (record,) = scored_trajectories([result], [rejected], FakeTokenizer(), step=1, rewrites=[rewrite])
    assert record["llm_calls"][0]["tokens"]["signal"]["rewrite"]["beacon"] == "B: moved"
