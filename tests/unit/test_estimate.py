"""`opd estimate`: a calibration run's records (start, steps, a validation) scaled to the whole job."""

from __future__ import annotations

from typing import Any

import pytest

from opd_trainer.driver.estimate import (
    calibration_spec,
    estimate_from_records,
    format_estimate,
    steps_to_calibrate,
    validations,
)
from opd_trainer.driver.metering import RECORDED
from opd_trainer.jobspec.job_spec import parse_job_spec


def _spec(**hyper_parameters: Any) -> Any:
    return parse_job_spec(
        {
            "job_name": "sized",
            "model": "/m",
            "teacher_model": "/t",
            "training_datasets": ["/d/train.jsonl"],
            "validation_datasets": ["/d/val.jsonl"],
            "hyper_parameters": {"max_steps": 10, **hyper_parameters},
            "budget": {"max_teacher_tokens": 5},
            "report_to": ["tensorboard"],
        }
    )


def _record(kind: str, step: int, teacher_tokens: float, wall_s: float) -> dict[str, Any]:
    usage = dict.fromkeys(RECORDED, 0.0) | {"teacher_tokens": teacher_tokens, "wall_s": wall_s}
    return {"kind": kind, "step": step, **{f"usage/{k}": v for k, v in usage.items()}}


def test_validations_are_every_eval_steps_before_the_last_step_and_the_final_one() -> None:
    assert validations(_spec(eval_steps=4), 10) == 3  # steps 4 and 8, then the final one
    assert validations(_spec(eval_steps=5), 10) == 2  # step 5, then the final one (not step 10 twice)
    no_validation = _spec().model_copy(update={"validation_datasets": []})
    assert validations(no_validation, 10) == 0


def test_the_estimate_is_start_first_step_steady_steps_and_validations() -> None:
    records = [
        _record("eval", 0, 1000, 70),  # start-up, the teacher's baseline, the starting student
        _record("train", 1, 300, 5),
        _record("eval", 1, 200, 2),  # one validation of the trained student
        _record("train", 2, 500, 7),
        _record("eval", 2, 220, 2),
    ]
    spec = _spec(eval_steps=4)
    found = estimate_from_records(records, spec, total_steps=10)
    assert found["calibration_steps"] == 2 and found["validations"] == 3
    # The first step (300 tokens, 5 s) counts once; the other 9 are the later steps' mean.
    assert found["usage"]["teacher_tokens"] == pytest.approx(1000 + 300 + 9 * 500 + 3 * 200)
    assert found["usage"]["wall_s"] == pytest.approx(70 + 5 + 9 * 7 + 3 * 2)
    one_step = estimate_from_records(records[:3], spec, total_steps=10)
    assert one_step["usage"]["teacher_tokens"] == pytest.approx(1000 + 10 * 300 + 3 * 200)


def test_a_calibration_without_a_training_step_is_refused() -> None:
    with pytest.raises(ValueError, match="no training step"):
        estimate_from_records([_record("eval", 0, 1, 1)], _spec(), total_steps=10)


def test_the_calibration_validates_after_step_one_without_trackers_or_budget() -> None:
    spec = _spec(eval_steps=50, save_steps=10)
    calibrating = calibration_spec(spec, steps=2)
    assert calibrating.hyper_parameters.eval_steps == 1 and calibrating.hyper_parameters.save_steps == 3
    assert calibrating.report_to == [] and calibrating.budget.max_teacher_tokens is None
    assert calibrating.job_name == "sized-calibration" and spec.budget.max_teacher_tokens == 5
    # `opd estimate` stops its own run and keeps the job's schedule; a server dry run ends by itself.
    assert calibrating.hyper_parameters.max_steps == 10
    assert calibration_spec(spec, steps=2, ends_by_itself=True).hyper_parameters.max_steps == 2


def test_a_calibration_runs_at_most_the_jobs_steps_and_at_least_one() -> None:
    assert (steps_to_calibrate(10), steps_to_calibrate(1), steps_to_calibrate(10, asked=0)) == (2, 1, 1)


def test_the_estimate_prints_one_row_per_metered_key() -> None:
    records = [_record("eval", 0, 1000, 70), _record("train", 1, 300, 5), _record("train", 2, 500, 7)]
    text = format_estimate(estimate_from_records(records, _spec(), total_steps=10), "sized")
    lines = text.splitlines()
    assert lines[0] == "estimate for sized: 10 steps, 1 validations (from 2 calibration steps)"
    assert lines[1].split() == ["teacher", "tokens", "5,800"]  # 1000 + 300 + 9 x 500
