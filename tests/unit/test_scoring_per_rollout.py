"""The teacher scores each rollout as soon as it ends (`JobDriver._sample_and_score`), not when the
whole batch ends; segments come back in rollout order, and a failed batch leaves no scoring behind.

Fakes stand in for the rollout runner and the teacher engine group (the real ones: integration tests).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from opd_trainer.jobspec.dataset import Sample
from opd_trainer.jobspec.job_spec import parse_job_spec
from opd_trainer.records import LLMCall


class FakeRunner:
    """Rollout i ends after `i + 1` ticks; rollout 2 fails (no completion)."""

    def __init__(self, events: list[str], fail_batch: bool = False) -> None:
        self.events, self.fail_batch = events, fail_batch

    async def run(
        self,
        samples: list[Sample],
        n_rollouts: int,
        step: int,
        seeds: list[int],
        on_result: Callable[..., None],
    ) -> list[Any]:
        from opd_trainer.rollout.runner import RolloutResult

        async def one(index: int) -> RolloutResult:
            await asyncio.sleep(0.02 * (index + 1))
            completion = [] if index == 2 else [index, index]
            call = LLMCall(
                prompt_token_ids=[1, 2],
                completion_token_ids=completion,
                sampler_logprobs=[-1.0] * len(completion),
            )
            result = RolloutResult(
                group_id=0, index=index, rollout_id=f"r{index}", sample=samples[0], calls=[call]
            )
            self.events.append(f"rollout {index} ended")
            on_result(result)
            return result

        results = await asyncio.gather(*(one(i) for i in range(len(samples) * n_rollouts)))
        if self.fail_batch:
            raise RuntimeError("the pool died")
        return list(results)


class FakeTeacher:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    async def score_top_k_many(self, pairs: list[tuple[list[int], list[int]]], top_k: int) -> list[Any]:
        from opd_trainer.engine.vllm_engine import TeacherScores

        self.events.append(f"scoring {pairs[0][1][0]}")
        await asyncio.sleep(0.2)
        self.events.append(f"scored {pairs[0][1][0]}")
        return [
            TeacherScores(
                logprobs=np.full(len(c), -0.5, dtype=np.float32),
                top_ids=np.zeros((len(c), top_k), dtype=np.int32),
                top_logprobs=np.zeros((len(c), top_k), dtype=np.float32),
            )
            for _, c in pairs
        ]


def _phase(events: list[str], fail_batch: bool = False) -> Any:
    """The sample phase with a fake runner, scoring each rollout by the score phase with a fake
    teacher (`signal.scores.score_rollouts`), as `Sampler.start` wires them."""
    from opd_trainer.driver.step import sample_and_score
    from opd_trainer.driver.teachers import TeacherEngines
    from opd_trainer.signal.scores import score_rollouts

    spec = parse_job_spec(
        {
            "job_name": "j",
            "model": "s",
            "teacher_model": "t",
            "training_datasets": ["train.jsonl"],
            "hyper_parameters": {"n_rollouts": 4},
        }
    )
    hp = spec.hyper_parameters
    runner = FakeRunner(events, fail_batch)
    teachers = TeacherEngines(spec, {"teacher": FakeTeacher(events)})  # type: ignore[dict-item]

    async def score(results: list[Any]) -> list[LLMCall]:
        return await score_rollouts(teachers, None, 512, hp, results)

    return lambda samples, step, seeds: sample_and_score(runner, score, samples, step, seeds, hp.n_rollouts)


def test_each_rollout_is_scored_as_it_ends_and_segments_keep_rollout_order(tmp_path: Path) -> None:
    events: list[str] = []
    sample_and_score = _phase(events)
    sample = Sample(source="train.jsonl", line=1, messages=[{"role": "user", "content": "hi"}], tools=None)

    async def go() -> tuple[list[Any], list[LLMCall]]:
        rollouts, scored = sample_and_score([sample], 0, [0, 1, 2, 3])
        return await rollouts, await scored

    results, segments = asyncio.run(go())
    # Rollout 0 was being scored before the last rollout ended (scoring takes 0.2 s, rollouts 0.02 s apart).
    assert events.index("scoring 0") < events.index("rollout 3 ended") < events.index("scored 0")
    assert "scoring 2" not in " ".join(events)  # a failed rollout is not scored
    assert [s.rollout_id for s in segments] == [0, 1, 3]
    assert [s.teacher_logprobs for s in segments] == [[-0.5, -0.5]] * 3
    assert len(results) == 4


def test_a_failed_batch_cancels_the_scoring_it_started(tmp_path: Path) -> None:
    events: list[str] = []
    sample_and_score = _phase(events, fail_batch=True)
    sample = Sample(source="train.jsonl", line=1, messages=[{"role": "user", "content": "hi"}], tools=None)

    async def go() -> None:
        rollouts, scored = sample_and_score([sample], 0, [0, 1, 2, 3])
        with pytest.raises(RuntimeError, match="the pool died"):
            await scored
        with pytest.raises(RuntimeError):
            await rollouts
        await asyncio.sleep(0.3)  # long enough for a scoring call to finish, had it not been cancelled

    asyncio.run(go())
    assert not any(event.startswith("scored") for event in events)
