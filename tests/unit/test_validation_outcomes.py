"""Per-sample validation outcomes (`driver/validation.py`: `validation_outcomes`, the `eval_outcomes`
event of the student's pass; `storage/run_dir.py`: `RunDir.validation_outcomes`; the benchmarks'
`JobRun.outcomes`): hand-made rollout results and a fake runner, no Ray, no engines."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from opd_trainer.driver.validation import evaluate, validation_outcomes
from opd_trainer.jobspec.dataset import Sample
from opd_trainer.jobspec.job_spec import parse_job_spec
from opd_trainer.records import LLMCall
from opd_trainer.rollout.agent_eval import agent_metrics, success_by_threshold
from opd_trainer.rollout.runner import RolloutResult
from opd_trainer.storage.run_dir import RunDir
from opd_trainer.wire.driver import DriverEvent


def _call(call_id: str | None, *, valid: bool = True) -> LLMCall:
    calls = [{"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    message = {"role": "assistant", "content": "", **({"tool_calls": calls} if call_id else {})}
    return LLMCall([1], [2], [-0.1], response_message=message, format_valid=valid)


def _answer(call_id: str, error: bool) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"error": "no"} if error else {})}


def _result(index: int, reward: float, calls: list[LLMCall], answers: list[dict[str, Any]], **kw: Any) -> Any:
    history = kw.pop("history", [])
    prompt = [{"role": "user", "content": f"q{index}"}, *history]
    sample = Sample("valid.jsonl", index, prompt, None, {"sample_id": f"s{index}"})
    return RolloutResult(
        index, index, f"r{index}", sample, calls=calls, messages=prompt + answers, reward=reward, **kw
    )


def _pass() -> list[RolloutResult]:
    injected = [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "old", "function": {"name": "f"}}]},
        _answer("old", True),
    ]
    return [
        # Two turns: a call that erred, then a repair and a plain answer; succeeded at 0.75.
        _result(0, 0.75, [_call("a"), _call("b"), _call(None)], [_answer("a", True), _answer("b", False)]),
        # A malformed turn and a wrong answer after an injected error in its history.
        _result(1, 0.0, [_call(None, valid=False)], [], history=injected),
        # The evaluator's score, not the reward, decides.
        _result(2, 1.0, [_call(None)], [], eval_score=0.5),
        # A failed rollout: no verdict, counted as not succeeded.
        _result(3, 0.0, [_call("c")], [], error="timed out"),
    ]


def test_each_samples_outcome_follows_the_agent_metrics_rules() -> None:
    results = _pass()
    succeeded = success_by_threshold(0.75)
    outcomes = validation_outcomes(results, succeeded)
    assert [o["sample_id"] for o in outcomes] == ["s0", "s1", "s2", "s3"]
    assert [o["success"] for o in outcomes] == [True, False, False, False]
    assert [o["score"] for o in outcomes] == [0.75, 0.0, 0.5, None]
    assert [o["failed"] for o in outcomes] == [False, False, False, True]
    assert [(o["turns"], o["turns_succeeded"], o["turns_format_valid"]) for o in outcomes] == [
        (3, 2, 3),
        (1, 0, 0),
        (1, 1, 1),
        (0, 0, 0),
    ]
    assert [o["format_valid"] for o in outcomes] == [True, False, True, False]
    assert [o["tool_calls"] for o in outcomes] == [2, 0, 0, 0]  # the injected call is not the agent's
    assert [o["wrong_history"] for o in outcomes] == [False, True, False, False]
    # The pass's metrics are the outcomes' shares.
    metrics = agent_metrics(results, succeeded)
    assert metrics["agent/task_success"] == sum(o["success"] for o in outcomes) / 4
    ok, turns = (sum(o[k] for o in outcomes) for k in ("turns_succeeded", "turns"))
    assert metrics["agent/turn_success"] == ok / turns
    assert metrics["agent/format_valid_turns"] == sum(o["turns_format_valid"] for o in outcomes) / turns
    assert metrics["agent/self_correction_success"] == 0.0
    json.dumps(outcomes)


def _evaluate(results: list[RolloutResult], label: str, *, teacher: bool) -> list[tuple[str, dict[str, Any]]]:
    spec = parse_job_spec(
        {
            "job_name": "j",
            "model": "s",
            "teacher_model": "t",
            "training_datasets": ["t.jsonl"],
            "hyper_parameters": {"eval_success_threshold": 0.75},
        }
    )

    async def validate(*_: Any, **__: Any) -> list[RolloutResult]:
        return results

    async def no_kl(*_: Any) -> None:
        return None

    runner = SimpleNamespace(validate=validate)
    c: Any = SimpleNamespace(spec=spec, runner=runner, teacher_runner=runner)
    events: list[tuple[str, dict[str, Any]]] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("opd_trainer.driver.validation.validation_reverse_kl", no_kl)
        samples = [r.sample for r in results]
        asyncio.run(
            evaluate(c, samples, label, lambda kind, _, **data: events.append((kind, data)), teacher=teacher)
        )
    return events


def test_the_students_pass_emits_its_outcomes_and_the_run_dir_reads_them_back(tmp_path: Path) -> None:
    results = _pass()
    assert "eval_outcomes" not in [kind for kind, _ in _evaluate(results, "teacher", teacher=True)]
    log = RunDir(tmp_path)
    for seq, label in enumerate(("student before", "step 2", "student after")):
        for kind, data in _evaluate(results, label, teacher=False):
            log.event(DriverEvent(seq=seq, time=1.0, type=kind, message="", data=data))
    passes = log.validation_outcomes()
    assert [p["label"] for p in passes] == ["student before", "step 2", "student after"]
    assert passes[1]["outcomes"] == validation_outcomes(results, success_by_threshold(0.75))

    # The benchmarks' JobRun pairs each pass with its eval record's step.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from harness import JobRun, outcomes_by_step

    records = [
        {"kind": "eval", "step": 0},
        {"kind": "train", "step": 1, "time/step_s": 1.0},
        {"kind": "train", "step": 2, "time/step_s": 1.0},
        {"kind": "eval", "step": 2},
        {"kind": "train", "step": 3, "time/step_s": 1.0},
        {"kind": "eval", "step": 3},
    ]
    by_step = outcomes_by_step(records, passes)
    assert sorted(by_step) == [0, 2, 3] and by_step[2] == passes[1]["outcomes"]
    run = JobRun(records, {}, 1.0, by_step)
    assert run.outcomes_at(3)[0]["sample_id"] == "s0" and run.outcomes_at(1) == []
