"""When a LoRA job's teacher is its student's base model, served by the student's own engines.

`teacher_model: self` is the student's model (`JobSpec._teacher_self`). A LoRA job trains an adapter
only and its student engines serve that base model as it is (a request without an adapter), so such a
job starts no teacher engine: its teacher is a view of the student's engines whose requests run the
base model (`engine/adapters.py` `BASE_MODEL_CLIENT`, `driver/components.py`). Weight updates are
adapter updates, so the teacher stays the initial student, as `self` promises.
"""

from __future__ import annotations

from pathlib import Path

from opd_trainer.jobspec.job_spec import JobSpec


def teacher_is_student_base(spec: JobSpec) -> bool:
    """Whether `spec`'s teacher scores on its student's engines: the job trains LoRA, has one teacher
    (several teachers start their own engines, even one naming the student), that teacher's model is
    the student's (`self`, or the same folder) and its engines would load it at the student's dtype
    (another dtype is another model: its own engines)."""
    teachers = spec.teachers
    if spec.hyper_parameters.lora is None or len(teachers) != 1:
        return False
    if spec.resources.teacher.dtype != spec.resources.student.dtype:
        return False
    return _same_model(teachers[0].model, spec.model)


def _same_model(a: str, b: str) -> bool:
    if a == b:
        return True
    first, second = Path(a), Path(b)
    return first.exists() and second.exists() and first.resolve() == second.resolve()
