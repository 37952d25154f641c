"""Engine settings for the tiny models on a CPU box (the embedded default)."""

from __future__ import annotations

import json
from pathlib import Path

from opd_trainer.engine.vllm_engine import EngineConfig, EnginePlacement

# The tiny models need a few MB of KV cache per sequence; 128 MiB holds hundreds in flight.
TINY_KV_CACHE_BYTES = 128 * 1024**2


def tiny_engine_resources(replicas: int = 1) -> EnginePlacement:
    """float32: the tiny models are saved in float32."""
    return EnginePlacement(replicas=replicas, kv_cache_memory_bytes=TINY_KV_CACHE_BYTES, dtype="float32")


def tiny_engine_config(model_dir: Path, replicas: int = 1) -> EngineConfig:
    """The tiny model's whole context window on CPU engines."""
    max_positions = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    return EngineConfig(
        model=str(model_dir), max_model_len=max_positions, resources=tiny_engine_resources(replicas)
    )
