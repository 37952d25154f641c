"""Pre-flight checks that reject a job before step 0 with a reason a user can act on."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.dataset import TASK_RECORDS_NEED_A_ROLLOUT, Sample, ground_truth_of

# Config keys different model families use for their context window, most common first.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def model_context_length(model_path: str, field: str) -> int | None:
    """The model's context window from its `config.json` (top level or `text_config`); None if unstated.

    Read as JSON rather than through `AutoConfig`, so a model whose architecture this transformers does
    not know still gets its context checked, and nothing is imported or downloaded.
    """
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}", field=field) from None
    for section in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _which(field: str) -> str:
    return "student" if field == "model" else "teacher" if field == "teacher_model" else f"teacher ({field})"


def preflight_models(max_length: int | None, sources: dict[str, str]) -> int:
    """Pre-flight of a job's models (`JobSpec.weight_sources`: the student as `model`, then each
    teacher by its field): every teacher has the student's tokenizer; returns the job's max length."""
    for field, path in sources.items():
        if field != "model":
            check_same_tokenizer(sources["model"], path, field)
    return resolve_max_length(max_length, sources)


def resolve_max_length(max_length: int | None, sources: dict[str, str]) -> int:
    """`hyper_parameters.max_length`, defaulting to the models' context; beyond it is a `ConfigError`.
    `sources`: each model's folder by the field that names it (`JobSpec.weight_sources`).

    Every engine holds the whole prompt + completion (a teacher scores the student's exact tokens), so
    the smallest window bounds the job. Checked before any engine starts: vLLM would otherwise refuse
    the length only after seconds of start-up, with an error naming its own setting.
    """
    windows = {field: model_context_length(path, field) for field, path in sources.items()}
    known = {field: window for field, window in windows.items() if window is not None}
    if not known:
        if max_length is None:
            raise ConfigError(
                "the models' config.json states no context length (max_position_embeddings); set it",
                field="hyper_parameters.max_length",
            )
        return max_length
    field, context = min(known.items(), key=lambda item: item[1])
    if max_length is None:
        return context
    if max_length > context:
        raise ConfigError(
            f"{max_length} tokens exceeds the {_which(field)}'s context of {context} "
            f"(max_position_embeddings in its config.json); set at most {context}, or leave it unset",
            field="hyper_parameters.max_length",
        )
    return max_length


@dataclass(frozen=True)
class TokenizerIdentity:
    """What the teacher must share with the student: its vocabulary (as a digest) and chat template."""

    vocab_size: int
    vocab_digest: str
    chat_template: str


def _folder_state(path: Path) -> tuple[tuple[str, int, int], ...]:
    """Names, sizes and mtimes of a model folder's files: a changed tokenizer file changes it."""
    return tuple(
        sorted(
            (entry.name, entry.stat().st_size, entry.stat().st_mtime_ns)
            for entry in os.scandir(path)
            if entry.is_file()
        )
    )


# transformers resolves `AutoTokenizer` through a lazy module that is not thread-safe on first use:
# submissions pre-flighting at once in a fresh server fail with "cannot import name 'AutoTokenizer'
# from 'transformers'". The job server pre-flights in threads.
_IMPORT_LOCK = threading.Lock()


def _auto_tokenizer() -> Any:
    with _IMPORT_LOCK:
        # Lazy: transformers/huggingface_hub load only when a model is read, not with the spec.
        from transformers import AutoTokenizer
    return AutoTokenizer


def import_tokenizer_support() -> None:
    """Imports what the tokenizer check needs (transformers: seconds), for a server to do at start."""
    _auto_tokenizer()


@lru_cache(maxsize=64)
def _identity(path: str, _state: tuple[tuple[str, int, int], ...]) -> TokenizerIdentity:
    tokenizer = _auto_tokenizer().from_pretrained(path, trust_remote_code=False)
    vocab = sorted(tokenizer.get_vocab().items())
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
    return TokenizerIdentity(len(vocab), digest, tokenizer.chat_template or "")


def tokenizer_identity(model_path: str, field: str) -> TokenizerIdentity:
    """The model's tokenizer identity, loaded once per state of its folder: the job server pre-flights
    every submission, and loading a tokenizer costs tens of milliseconds (tiny) to seconds (large)."""
    try:
        folder = Path(model_path).resolve()
        return _identity(str(folder), _folder_state(folder))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot load the {_which(field)}'s tokenizer from {model_path}: {exc}", field=field
        ) from None


def check_same_tokenizer(student_path: str, teacher_path: str, field: str = "teacher_model") -> None:
    """The teacher (named by `field`) must score the student's exact token ids: same vocabulary and
    chat template. Cross-tokenizer distillation is not supported."""
    student = tokenizer_identity(student_path, "model")
    teacher = tokenizer_identity(teacher_path, field)
    if student.vocab_digest != teacher.vocab_digest:
        student_vocab = _auto_tokenizer().from_pretrained(student_path, trust_remote_code=False).get_vocab()
        teacher_vocab = _auto_tokenizer().from_pretrained(teacher_path, trust_remote_code=False).get_vocab()
        differing = len(set(student_vocab.items()) ^ set(teacher_vocab.items()))
        raise ConfigError(
            f"tokenizer differs from the student's: vocabularies of {len(teacher_vocab)} and "
            f"{len(student_vocab)} tokens, {differing} (token, id) pairs not shared; the teacher "
            "cannot score the student's token ids",
            field=field,
        )
    if student.chat_template != teacher.chat_template:
        raise ConfigError(
            "chat template differs from the student's: prompts would be tokenized differently",
            field=field,
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


def check_references(samples: list[Sample], teacher_hindsight: str) -> None:
    """`teacher_hindsight: reference` needs reference answers to show the teacher: at least one
    training sample must carry one (`rollout_extra.ground_truth` or `.solution`)."""
    if teacher_hindsight == "reference" and all(ground_truth_of(s) is None for s in samples):
        raise ConfigError(
            "'reference' shows the teacher each sample's reference answer, and no training sample has one "
            "(rollout_extra.ground_truth or rollout_extra.solution)",
            field="hyper_parameters.teacher_hindsight",
        )


def check_task_records(samples: list[Sample], field: str, has_rollout: bool) -> None:
    """Task records (no `messages`) become conversations only through a rollout component."""
    if not has_rollout and any(not s.messages for s in samples):
        raise ConfigError(f"{field} {TASK_RECORDS_NEED_A_ROLLOUT}", field=field)
