"""A LoRA job whose teacher is its student's model (`teacher_model: self`) scores on the student's engines'
base model (`jobspec/base_teacher.py`, `engine/adapters.BASE_MODEL_CLIENT`): when that applies, that the
base model's client never gets an adapter, and that the memory plan then has no teacher engine."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_memory_plan import CPU, _model

from opd_trainer.engine.adapters import BASE_MODEL_CLIENT, OWN_JOB, ServedAdapters
from opd_trainer.errors import WeightSyncError
from opd_trainer.jobspec.base_teacher import teacher_is_student_base
from opd_trainer.jobspec.job_spec import parse_job_spec
from opd_trainer.jobspec.memory_plan import plan_roles


def _spec(model: Path, teacher_model: Any = "self", lora: bool = True, **resources: dict[str, Any]) -> Any:
    hp: dict[str, Any] = {"ppo_mini_batch_size": 8, "max_tokens": 64}
    if lora:
        hp["lora"] = {"r": 8}
    return parse_job_spec(
        {
            "job_name": "self-taught",
            "model": str(model),
            "teacher_model": teacher_model,
            "training_datasets": ["/d/train.jsonl"],
            "hyper_parameters": hp,
            "resources": resources,
        }
    )


def test_a_lora_job_with_its_student_as_only_teacher_scores_on_the_student_base(tmp_path: Path) -> None:
    student, other = _model(tmp_path / "student"), _model(tmp_path / "other")
    assert teacher_is_student_base(_spec(student))  # `self`
    assert teacher_is_student_base(_spec(student, str(student)))  # the same folder, named
    assert teacher_is_student_base(_spec(student, str(tmp_path / "student" / ".." / "student")))
    assert not teacher_is_student_base(_spec(student, lora=False))  # full training changes the student
    assert not teacher_is_student_base(_spec(student, str(other)))
    # Another dtype is another model: the teacher keeps engines of its own.
    assert not teacher_is_student_base(_spec(student, student={"dtype": "bfloat16"}, teacher={}))
    assert teacher_is_student_base(_spec(student, student={"dtype": "float32"}, teacher={"dtype": "float32"}))
    # Several teachers start their engines, one naming the student too.
    several = [
        {"name": "own", "model": "self"},
        {"name": "other", "model": str(other), "data_tags": ["x"]},
    ]
    assert not teacher_is_student_base(_spec(student, several))


def test_the_memory_plan_has_no_teacher_engine_when_the_teacher_is_the_student_base(tmp_path: Path) -> None:
    student, other = _model(tmp_path / "student"), _model(tmp_path / "other")

    def roles(spec: Any) -> list[str]:
        return [r.role for r in plan_roles(spec, 256, CPU)]

    assert roles(_spec(student)) == ["student", "learner"]
    assert roles(_spec(student, str(other))) == ["student", "teacher", "learner"]
    assert roles(_spec(student, lora=False)) == ["student", "teacher", "learner"]


def test_the_base_model_client_never_has_an_adapter() -> None:
    adapters = ServedAdapters("student-0", Path("/nonexistent"))
    adapters._current[OWN_JOB] = SimpleNamespace(lora_name="job-v1")  # type: ignore[assignment]
    assert adapters.current() is adapters.current(OWN_JOB) is not None
    assert adapters.current(BASE_MODEL_CLIENT) is None
    handoff = SimpleNamespace(version=1)
    with pytest.raises(WeightSyncError, match="no adapter"):
        asyncio.run(adapters.swap(object(), handoff, BASE_MODEL_CLIENT))  # type: ignore[arg-type]
