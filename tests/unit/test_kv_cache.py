"""CPU KV-cache sizing for jobs that leave `kv_cache_memory_bytes` unset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opd_trainer.errors import ConfigError
from opd_trainer.kv_cache import BLOCK_SLACK, MIN_BYTES, cpu_kv_cache_bytes, kv_bytes_per_token

GiB = 1024**3


def _model(tmp_path: Path, **config: object) -> str:
    base = {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896}
    (tmp_path / "config.json").write_text(json.dumps(base | config))
    return str(tmp_path)


def test_bytes_per_token_follow_layers_kv_heads_head_dim_and_dtype(tmp_path: Path) -> None:
    model = _model(tmp_path, dtype="bfloat16")
    # Qwen2.5-0.5B's shape: 2 (K, V) · 24 layers · 2 KV heads · 64 head dim · 2 bytes.
    assert kv_bytes_per_token(model, "auto") == 2 * 24 * 2 * 64 * 2
    assert kv_bytes_per_token(model, "float32") == 2 * 24 * 2 * 64 * 4


def test_explicit_head_dim_and_text_config_are_read(tmp_path: Path) -> None:
    inner = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 128, "head_dim": 48}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": inner}))
    assert kv_bytes_per_token(str(tmp_path), "float16") == 2 * 2 * 4 * 48 * 2


def test_sized_for_the_steps_sequences_when_memory_allows(tmp_path: Path) -> None:
    model = _model(tmp_path, dtype="bfloat16")
    per_token = kv_bytes_per_token(model, "auto")
    got = cpu_kv_cache_bytes(model, "auto", 2048, 32, field="f", available=64 * GiB)
    assert got == int(per_token * 2048 * 32 * BLOCK_SLACK)


def test_capped_by_free_memory_and_floored(tmp_path: Path) -> None:
    model = _model(tmp_path, dtype="bfloat16")
    assert cpu_kv_cache_bytes(model, "auto", 32768, 512, field="f", available=8 * GiB) == int(0.2 * 8 * GiB)
    assert cpu_kv_cache_bytes(model, "auto", 16, 1, field="f", available=8 * GiB) == MIN_BYTES


def test_refused_naming_the_field_when_one_sequence_does_not_fit(tmp_path: Path) -> None:
    model = _model(tmp_path, dtype="float32")
    with pytest.raises(ConfigError) as raised:
        cpu_kv_cache_bytes(
            model, "auto", 131072, 8, field="resources.teacher.kv_cache_memory_bytes", available=GiB
        )
    assert raised.value.field == "resources.teacher.kv_cache_memory_bytes"
    assert "max_length" in raised.value.message
