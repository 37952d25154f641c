"""Pre-flight checks that reject a job before step 0 with a reason a user can act on."""

from __future__ import annotations

from typing import Any

from opd_trainer.errors import ConfigError


def check_same_tokenizer(student_path: str, teacher_path: str) -> None:
    """The teacher must score the student's exact token ids: same vocabulary and chat template."""
    from transformers import AutoTokenizer

    try:
        student = AutoTokenizer.from_pretrained(student_path)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot load the student's tokenizer from {student_path}: {exc}", field="model"
        ) from None
    try:
        teacher = AutoTokenizer.from_pretrained(teacher_path)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot load the teacher's tokenizer from {teacher_path}: {exc}", field="teacher_model"
        ) from None
    student_vocab, teacher_vocab = student.get_vocab(), teacher.get_vocab()
    if student_vocab != teacher_vocab:
        differing = len(set(student_vocab.items()) ^ set(teacher_vocab.items()))
        raise ConfigError(
            f"tokenizer differs from the student's: vocabularies of {len(teacher_vocab)} and "
            f"{len(student_vocab)} tokens, {differing} (token, id) pairs not shared; the teacher "
            "cannot score the student's token ids",
            field="teacher_model",
        )
    if (student.chat_template or "") != (teacher.chat_template or ""):
        raise ConfigError(
            "chat template differs from the student's: prompts would be tokenized differently",
            field="teacher_model",
        )


async def check_drift(learner: Any, probe: list[Any], max_drift: float) -> dict[str, float]:
    """Learner vs sampler logprobs of the same tokens; a large gap means mismatched weights/numerics."""
    if not probe:
        return {"mean": 0.0, "max": 0.0, "tokens": 0.0}
    learner_logprobs = await learner.compute_logprobs(probe)
    diffs = [
        abs(a - b)
        for segment, got in zip(probe, learner_logprobs, strict=True)
        for a, b in zip(segment.sampler_logprobs, got, strict=True)
    ]
    mean, worst = sum(diffs) / len(diffs), max(diffs)
    if mean > max_drift:
        raise ConfigError(
            f"learner and sampler disagree on the probe batch: mean |Δlogprob| {mean:.4f}, max {worst:.4f} "
            f"(> {max_drift}); the engine and learner do not compute the same model",
            field="hyper_parameters.max_drift",
        )
    return {"mean": mean, "max": worst, "tokens": float(len(diffs))}
