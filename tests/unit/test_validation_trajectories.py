"""Validation rollouts recorded for the side-by-side view (`driver/validation.py`: `validation_records`,
`evaluate`'s `record`; `storage/run_dir.py`: validation_trajectories.jsonl). Hand-made rollout results
and a fake runner; no Ray, no engines."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from opd_trainer.driver.validation import VALIDATION_TRAJECTORIES_PER_PASS, evaluate, validation_records
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
    assert "divergence" not in first  # greedy and untrained: no per-token view
    json.dumps(first)  # JSON-able as written


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
    recorded: list[list[RolloutResult]] = []
    samples = [r.sample for r in results]
    asyncio.run(evaluate(c, samples, "teacher", lambda *a, **k: None, teacher=True, record=recorded.append))
    assert recorded == [results] and validations == ["eval-teacher"]  # one pass, no extra call


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
