"""A LoRA checkpoint used where a whole model is needed: as a later job's `model` / `teacher_model`, or
downloaded with `--merged`. The checkpoint's `student/` folder holds the adapter (PEFT's files and the
tokenizer); the merged model is made once, on first need, in a folder beside it (`student-merged/`),
and reused after that.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

from opd_trainer.learner.adapters import merged_model

MERGED_SUFFIX = "-merged"


def is_adapter_folder(path: str | Path) -> bool:
    """A PEFT adapter folder (what a LoRA job's checkpoint holds), not a whole model."""
    folder = Path(path)
    return (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file()


def merged_folder(adapter_dir: str | Path) -> Path:
    """The adapter in `adapter_dir` merged into its base model, as a plain Hugging Face folder beside
    it; made the first time (into a private folder, renamed into place, so that two callers at once
    never see half a model), reused after."""
    adapter_dir = Path(adapter_dir)
    target = adapter_dir.with_name(adapter_dir.name + MERGED_SUFFIX)
    if (target / "config.json").is_file():
        return target
    partial = adapter_dir.with_name(f".{adapter_dir.name}{MERGED_SUFFIX}-{uuid.uuid4().hex[:8]}")
    try:
        merged_model(adapter_dir, partial)
        try:
            partial.rename(target)
        except OSError:  # another caller finished first: theirs is the same model
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def whole_model(path: str) -> str:
    """`path` itself for a model folder; for a LoRA adapter folder, its merged model's folder."""
    return str(merged_folder(path)) if is_adapter_folder(path) else path
