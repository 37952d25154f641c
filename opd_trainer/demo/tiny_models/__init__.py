"""Tiny Qwen2 teacher and student for tests and demos, built on disk from scratch with no download.

`build_tiny_models(out_dir)` trains a byte-level BPE tokenizer (Qwen2.5 ChatML layout, hermes tool-call
markers) and two small `Qwen2ForCausalLM` checkpoints on the synthetic tool-routing task: a competent
teacher and a weaker student of the same architecture that on-policy distillation can improve. Both load
with transformers' `Auto*` classes and with vLLM. `variant="self_correction"` trains them on the task plus
the self-correction turns of `demo/tool_routing/self_correction.py` and writes its agent episodes.

`factory` builds and caches them, `training` holds the training phases and greedy validation,
`tokenizer` the tokenizer and ChatML rendering, `serving` the engine settings for them on a CPU box.
The factory names are imported on first use, so that `opd_trainer.demo.tiny_models.tokenizer` (and unit
tests of it) never pull in torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from opd_trainer.demo.tiny_models.tokenizer import (
    IM_END,
    IM_START,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
    chat_template,
    render_chat,
    save_tokenizer,
    train_tokenizer,
    wrap_tokenizer,
)

if TYPE_CHECKING:
    from opd_trainer.demo.tiny_models.factory import (
        STUDENT,
        TEACHER,
        ModelSpec,
        TinyModels,
        build_tiny_models,
        cache_key,
        default_threads,
    )

_FROM_FACTORY = frozenset(
    {"STUDENT", "TEACHER", "ModelSpec", "TinyModels", "build_tiny_models", "cache_key", "default_threads"}
)


def __getattr__(name: str) -> Any:
    if name in _FROM_FACTORY:
        return getattr(importlib.import_module("opd_trainer.demo.tiny_models.factory"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "IM_END",
    "IM_START",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "STUDENT",
    "TEACHER",
    "TOOL_TOKENS",
    "ModelSpec",
    "TinyModels",
    "build_tiny_models",
    "cache_key",
    "chat_template",
    "default_threads",
    "render_chat",
    "save_tokenizer",
    "train_tokenizer",
    "wrap_tokenizer",
]
