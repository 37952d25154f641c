"""Validation rollouts recorded for the side-by-side view (`driver/validation.py`: `validation_records`,
`evaluate`'s `record`, the teacher's view of the student's tokens; `storage/run_dir.py`:
validation_trajectories.jsonl). Hand-made rollout results, a fake runner and fake teachers; no Ray,
no engines."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from opd_trainer.driver.teachers import Scored
from opd_trainer.driver.validation import VALIDATION_TRAJECTORIES_PER_PASS, evaluate, validation_records
from opd_trainer.engine.vllm_engine import TeacherScores
from opd_trainer.jobspec.dataset import Sample
from opd_trainer.jobspec.job_spec import parse_job_spec
from opd_trainer.records import LLMCall
from opd_trainer.rollout.runner import RolloutResult
from opd_trainer.storage.run_dir import RunDir


def _result(index: int, answer: str, score: float | None, error: str = "") -> RolloutResult:
    prompt = [{"role": "user", "content": f"question {index}"}]
    sample = Sample("valid.jsonl", index, prompt, None, {"sample_id": f"q{index}"})
    call = LLMCall([1, 2], [3], [-0.5], response_message={"role": "assistant", "content": answer})
    return RolloutResult(
        index,
        index,
        f"job-eval-r{index}",
        sample,
        calls=[call],
        messages=[*prompt, {"role": "assistant", "content": answer}],
        eval_score=score,
        eval_metrics={} if score is None else {"exact_match": score},
        eval_error=error,
    )


def test_a_record_is_the_rollouts_trajectory_with_the_pass_and_the_evaluators_score() -> None:
    results = [_result(0, "4", 1.0), _result(1, "5", None, error="evaluator raised")]
    first, second = validation_records(results, 3, "step 3", "student")
    assert list(first)[:3] == ["step", "label", "model"]  # step first: RunDir reads it from the line's start
    assert [first[k] for k in ("step", "label", "model", "sample_id")] == [3, "step 3", "student", "q0"]
    assert first["messages"][-1] == {"role": "assistant", "content": "4"}
    assert first["llm_calls"][0]["response"]["content"] == "4" and first["llm_calls"][0]["tokens"] is None
    assert [first[k] for k in ("eval_score", "eval_metrics", "eval_error")] == [1.0, {"exact_match": 1.0}, ""]
    assert (second["eval_score"], second["eval_error"]) == (None, "evaluator raised")
    assert first["divergence"] is None  # not scored by the teacher: no per-token view
    json.dumps(first)  # JSON-able as written


def _no_event(*_: Any, **__: Any) -> None:
    pass


class _Tokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


def test_a_student_record_shows_the_teachers_view_of_every_token_it_wrote() -> None:
    """With the calls as the teacher scored them, each call has its tokens' log-ratios and the record
    the mean of them as its divergence, as a step's trajectory does; a failed rollout has neither."""
    results = [_result(0, "4", 1.0), _result(1, "5", 0.0, error="")]
    results[1].error = "timed out"
    scored = [dataclasses.replace(results[0].calls[0], teacher_logprobs=[-2.0], rollout_id=0)]
    first, second = validation_records(results, 2, "step 2", "student", scored, _Tokenizer())
    assert first["llm_calls"][0]["tokens"] == {"text": ["<3>"], "log_ratio": [1.5]}  # -0.5 - (-2.0)
    assert first["divergence"] == 1.5
    assert second["llm_calls"][0]["tokens"] is None and second["divergence"] is None
    json.dumps(first)


def test_only_the_first_rollouts_of_a_pass_are_recorded_in_sample_order() -> None:
    results = [_result(i, str(i), 0.0) for i in range(VALIDATION_TRAJECTORIES_PER_PASS + 5)]
    records = validation_records(results, 0, "teacher", "teacher")
    assert [r["sample_id"] for r in records] == [f"q{i}" for i in range(VALIDATION_TRAJECTORIES_PER_PASS)]


def test_evaluate_hands_its_greedy_rollouts_to_record_and_asks_no_more_of_the_runner() -> None:
    spec = parse_job_spec(
        {"job_name": "j", "model": "s", "teacher_model": "t", "training_datasets": ["t.jsonl"]}
    )
    results = [_result(0, "4", 1.0), _result(1, "5", 0.0)]
    validations: list[str] = []

    async def validate(samples: list[Sample], tag: str, seeds: list[int], **_: Any) -> list[RolloutResult]:
        validations.append(tag)
        return results

    c: Any = SimpleNamespace(spec=spec, teacher_runner=SimpleNamespace(validate=validate))
    recorded: list[tuple[list[RolloutResult], list[LLMCall]]] = []
    samples = [r.sample for r in results]

    def record(rollouts: list[RolloutResult], scored: list[LLMCall]) -> None:
        recorded.append((rollouts, scored))

    asyncio.run(evaluate(c, samples, "teacher", lambda *a, **k: None, teacher=True, record=record))
    # One pass, no extra call; the teacher's own pass is not scored by the teacher.
    assert recorded == [(results, [])] and validations == ["eval-teacher"]


def test_the_students_recorded_rollouts_are_scored_by_the_teacher_without_hindsight_notes() -> None:
    spec = parse_job_spec(
        {
            "job_name": "j",
            "model": "s",
            "teacher_model": "t",
            "training_datasets": ["t.jsonl"],
            "hyper_parameters": {
                "teacher_hindsight": "reference",
                "distill_loss": "sampled",
                "teacher_top_k": 0,
            },
        }
    )
    results = [_result(i, str(i), 1.0) for i in range(VALIDATION_TRAJECTORIES_PER_PASS + 3)]
    asked: list[list[tuple[list[int], list[int]]]] = []

    async def validate(samples: list[Sample], tag: str, seeds: list[int], **_: Any) -> list[RolloutResult]:
        return results

    async def score_top_k(names: list[str], pairs: list[Any], top_k: int) -> list[Scored]:
        asked.append(pairs)
        scores = TeacherScores(
            np.array([-1.0], dtype=np.float32), np.zeros((1, 0), np.int32), np.zeros((1, 0))
        )
        return [Scored(scores, "t", 0.01) for _ in pairs]

    teachers = SimpleNamespace(score_top_k=score_top_k, name_for=lambda sample: "t")
    c: Any = SimpleNamespace(
        spec=spec,
        runner=SimpleNamespace(validate=validate),
        teachers=teachers,
        tokenizer=_Tokenizer(),
        max_length=64,
    )
    recorded: list[list[LLMCall]] = []

    async def no_kl(*_: Any) -> None:
        return None

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("opd_trainer.driver.validation.validation_reverse_kl", no_kl)
        asyncio.run(
            evaluate(
                c,
                [r.sample for r in results],
                "step 1",
                lambda *a, **k: None,
                record=lambda r, s: recorded.append(s),
            )
        )
    (scored,) = recorded
    # Only the recorded rollouts, on the exact tokens the student wrote (no note in the prompt).
    assert asked == [[([1, 2], [3])] * VALIDATION_TRAJECTORIES_PER_PASS]
    assert [s.rollout_id for s in scored] == list(range(VALIDATION_TRAJECTORIES_PER_PASS))
    assert all(s.teacher_logprobs == [-1.0] and not s.teacher_saw_note for s in scored)


def test_run_dir_reads_the_passes_and_a_steps_records_and_truncates_them_on_resume(tmp_path: Path) -> None:
    log = RunDir(tmp_path)
    assert log.validation_passes() == [] and log.validation_trajectories() == []
    passes = ((0, "teacher", "teacher"), (0, "student before", "student"), (2, "step 2", "student"))
    for step, label, model in passes:
        log.add_validation_trajectories(validation_records([_result(0, "é", 1.0)], step, label, model))
    assert log.validation_passes() == [
        {"step": 0, "label": "teacher", "model": "teacher"},
        {"step": 0, "label": "student before", "model": "student"},
        {"step": 2, "label": "step 2", "model": "student"},
    ]
    assert [r["label"] for r in log.validation_trajectories(0)] == ["teacher", "student before"]
    assert log.validation_trajectories(2)[0]["messages"][-1]["content"] == "é"

    log.truncate_after(1)  # a resume from step 1's checkpoint redoes step 2's validation
    assert [p["step"] for p in log.validation_passes()] == [0, 0]
