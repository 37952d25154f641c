"""The memory plan: exact parameter counts from safetensors headers, the learner's terms under each
setting, and a job that cannot fit refused with the field, the numbers and settings that would fit."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.job_spec import parse_job_spec
from opd_trainer.jobspec.memory_plan import (
    ENGINE_RAY_WORKER_BYTES,
    LEARNER_RUNTIME_BYTES,
    LOGITS_COPIES,
    Budget,
    GiB,
    apply_suggestion,
    check_memory_plan,
    config_parameters,
    format_plan,
    learner_plan,
    learner_zero_stage,
    lora_parameters,
    model_shape,
    plan_memory,
    read_config,
    role_errors,
    safetensors_parameters,
)

# A Qwen2-shaped decoder small enough to write by hand.
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 1000
HEAD_DIM = HIDDEN // HEADS


def _config(**extra: Any) -> dict[str, Any]:
    return {
        "model_type": "qwen2",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        **extra,
    }


def _qwen2_tensors() -> dict[str, list[int]]:
    """Every tensor of the model above, as Qwen2ForCausalLM names them (tied embeddings)."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    tensors = {"model.embed_tokens.weight": [VOCAB, HIDDEN], "model.norm.weight": [HIDDEN]}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}"
        tensors |= {
            f"{prefix}.self_attn.q_proj.weight": [q, HIDDEN],
            f"{prefix}.self_attn.q_proj.bias": [q],
            f"{prefix}.self_attn.k_proj.weight": [kv, HIDDEN],
            f"{prefix}.self_attn.k_proj.bias": [kv],
            f"{prefix}.self_attn.v_proj.weight": [kv, HIDDEN],
            f"{prefix}.self_attn.v_proj.bias": [kv],
            f"{prefix}.self_attn.o_proj.weight": [HIDDEN, q],
            f"{prefix}.mlp.gate_proj.weight": [INTER, HIDDEN],
            f"{prefix}.mlp.up_proj.weight": [INTER, HIDDEN],
            f"{prefix}.mlp.down_proj.weight": [HIDDEN, INTER],
            f"{prefix}.input_layernorm.weight": [HIDDEN],
            f"{prefix}.post_attention_layernorm.weight": [HIDDEN],
        }
    return tensors


def _write_safetensors(path: Path, tensors: dict[str, list[int]], dtype: str = "BF16") -> int:
    """A safetensors file by hand: 8-byte header length, JSON header, zeroed data. Returns the count."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors.items():
        size = 2 * (shape[0] * (shape[1] if len(shape) > 1 else 1))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded + bytes(offset))
    return sum(s[0] * (s[1] if len(s) > 1 else 1) for s in tensors.values())


def _model(folder: Path, with_weights: bool = True, **config: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(_config(**config)))
    if with_weights:
        _write_safetensors(folder / "model.safetensors", _qwen2_tensors())
    return folder


def _spec(model: Path, teacher: Path | None = None, **sections: dict[str, Any]) -> Any:
    return parse_job_spec(
        {
            "job_name": "sized",
            "model": str(model),
            "teacher_model": str(teacher or model),
            "training_datasets": ["/d/train.jsonl"],
            "hyper_parameters": {"ppo_mini_batch_size": 8, "max_tokens": 64, **sections.get("hp", {})},
            "resources": sections.get("resources", {}),
        }
    )


CPU = Budget("cpu", 64 * GiB, 64 * GiB)
GPU = Budget("cuda", 256 * GiB, 256 * GiB, device_bytes=80 * GiB)


def test_parameters_are_counted_exactly_from_the_safetensors_headers(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_config()))
    tensors = _qwen2_tensors()
    half = len(tensors) // 2
    names = list(tensors)
    expected = _write_safetensors(
        folder / "model-00001-of-00002.safetensors", {n: tensors[n] for n in names[:half]}
    )
    expected += _write_safetensors(
        folder / "model-00002-of-00002.safetensors", {n: tensors[n] for n in names[half:]}
    )
    counted = safetensors_parameters(folder)
    assert counted is not None and counted[0] == expected == sum(counted[1].values())
    assert counted[1] == {"BF16": expected}
    shape = model_shape(folder)
    assert shape.exact and shape.parameters == expected and shape.dtype == "bfloat16"
    # The config's formula (used when no safetensors file is there) agrees for this architecture.
    assert config_parameters(read_config(folder)) == expected
    assert not model_shape(_model(tmp_path / "bare", with_weights=False)).exact


def test_lora_parameters_are_rank_times_in_plus_out_per_targeted_projection(tmp_path: Path) -> None:
    shape = model_shape(_model(tmp_path / "m"))
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    assert lora_parameters(shape, 8, ["q_proj", "v_proj"]) == LAYERS * 8 * ((HIDDEN + q) + (HIDDEN + kv))


def _terms(spec: Any, budget: Budget = CPU, max_length: int = 256) -> dict[str, int]:
    shape = model_shape(spec.model)
    return {t.name: t.bytes for t in learner_plan(shape, spec, max_length, budget).terms}


def test_learner_terms_full_lora_checkpointing_zero3_and_offload(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    params = model_shape(model).parameters
    full = _terms(_spec(model))
    # One CPU rank: ZeRO-2 runs as stage 0 (`learner_zero_stage`): fp32 weights, autograd's gradients
    # once, AdamW's two moments, no fp32 master.
    assert learner_zero_stage(_spec(model), CPU) == 0
    assert full["weights"] == params * 4
    assert full["fp32 master"] == 0
    assert full["gradients"] == params * 4
    assert full["optimizer (AdamW)"] == 2 * params * 4
    assert full["runtime"] == LEARNER_RUNTIME_BYTES
    # The export streams the module's own tensors: one at a time, the largest (the embedding) counted.
    assert full["weight export"] == VOCAB * HIDDEN * 4
    assert full["logits"] == 8 * 64 * VOCAB * 4 * LOGITS_COPIES  # rows x max_tokens x vocab x fp32 x copies
    # With optimizer offload (or several ranks) the stage is kept: ZeRO-2's master and flat buffers.
    offloaded = _terms(_spec(model, resources={"zero_stage": 2, "optimizer_offload": True}))
    assert offloaded["fp32 master"] == params * 4
    assert offloaded["gradients"] == 3 * params * 4

    lora = _terms(_spec(model, hp={"lora": {"r": 8}}))
    adapter = lora_parameters(
        model_shape(model), 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert lora["weights"] == (params + adapter) * 4  # the frozen base stays
    assert lora["optimizer (AdamW)"] == 2 * adapter * 4
    assert lora["fp32 master"] == 0
    assert lora["weight export"] == adapter * 4  # the adapter's files
    assert lora["gradients"] == adapter * 4  # the adapter's alone

    checkpointed = _terms(_spec(model, hp={"gradient_checkpointing": True}))
    assert checkpointed["activations"] < full["activations"]
    assert {k: v for k, v in checkpointed.items() if k != "activations"} == {
        k: v for k, v in full.items() if k != "activations"
    }

    # ZeRO-3 over 4 GPUs: partitions of weights, master, gradients and optimizer; a quarter of the rows.
    zero3 = _terms(_spec(model, resources={"zero_stage": 3, "learner_gpus": 4}), GPU)
    one = _terms(_spec(model, resources={"zero_stage": 2, "learner_gpus": 1}), GPU)
    # On GPU the configured stage is kept: bf16 weights and gradients, ZeRO-2's fp32 master and flat
    # fp32 gradient partitions, the export one bf16 tensor at a time.
    assert one["weights"] == params * 2 and one["fp32 master"] == params * 4
    assert one["gradients"] == params * 2 + 2 * params * 4
    assert one["weight export"] == VOCAB * HIDDEN * 2
    assert zero3["optimizer (AdamW)"] == 2 * params * 4 // 4
    assert zero3["fp32 master"] == params * 4 // 4
    assert zero3["logits"] == one["logits"] // 4
    assert zero3["activations"] == one["activations"] // 4

    offload_spec = _spec(model, resources={"zero_stage": 2, "optimizer_offload": True})
    plan = learner_plan(model_shape(model), offload_spec, 256, GPU)
    where = {t.name: t.where for t in plan.terms}
    assert where["optimizer (AdamW)"] == where["fp32 master"] == "host"
    assert where["weights"] == where["gradients"] == "device"
    base = learner_plan(model_shape(model), _spec(model), 256, GPU)
    assert plan.where_bytes("device") == base.where_bytes("device") - 3 * params * 4


def test_the_reference_model_is_counted_only_with_kl_loss_coef(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    assert "reference model" not in _terms(_spec(model))
    assert (
        _terms(_spec(model, hp={"kl_loss_coef": 0.1}))["reference model"] == model_shape(model).parameters * 4
    )
    # Under LoRA the reference is the base with the adapter switched off: no copy.
    assert "reference model" not in _terms(_spec(model, hp={"kl_loss_coef": 0.1, "lora": {"r": 8}}))


def test_engines_plan_weights_kv_cache_and_runtime(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    spec = _spec(model, resources={"student": {"kv_cache_memory_bytes": 64 * 1024**2, "replicas": 2}})
    plan = plan_memory(spec, 256, CPU)
    student = plan.role("student")
    terms = {t.name: t.bytes for t in student.terms}
    assert student.count == 2
    assert terms["weights"] == model_shape(model).parameters * 2
    assert terms["KV cache"] == 64 * 1024**2
    assert terms["Ray worker"] == ENGINE_RAY_WORKER_BYTES
    # A full-training student maps the learner's handoff file (fp32 on CPU) while it loads, converting
    # one tensor at a time (the embedding, in the engine's bf16); the teacher loads no update.
    assert terms["weight update"] == model_shape(model).parameters * 4 + VOCAB * HIDDEN * 2
    assert "weight update" not in {t.name for t in plan.role("teacher").terms}
    # On GPU without a size, vLLM fills gpu_fraction of the device.
    gpu = plan_memory(_spec(model, resources={"student": {"gpu_fraction": 0.5}}), 256, GPU)
    assert gpu.role("student").where_bytes("device") == 40 * GiB
    lora = plan_memory(_spec(model, hp={"lora": {"r": 8}}), 256, CPU)
    assert "adapter slots" in {t.name for t in lora.role("student").terms}
    assert "weight update" not in {t.name for t in lora.role("student").terms}  # the adapter's files only
    assert plan.fits and "fits" in format_plan(plan)


def _oversized(tmp_path: Path) -> tuple[Any, Budget]:
    # A config-only model of ~1.1 B parameters against a node with 30 GiB available.
    big = _model(
        tmp_path / "big",
        with_weights=False,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=20,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
    )
    spec = _spec(
        big,
        resources={
            "student": {"kv_cache_memory_bytes": 256 * 1024**2},
            "teacher": {"kv_cache_memory_bytes": 256 * 1024**2},
        },
    )
    return spec, Budget("cpu", 64 * GiB, 30 * GiB)


def test_an_oversized_job_is_refused_naming_the_field_the_numbers_and_what_would_fit(tmp_path: Path) -> None:
    spec, budget = _oversized(tmp_path)
    with pytest.raises(ConfigError) as refused:
        check_memory_plan(spec, 512, budget)
    error = refused.value
    plan = plan_memory(spec, 512, budget)
    assert not plan.fits and plan.suggestions
    assert error.field == plan.suggestions[0].changes[-1][0]
    message = str(error)
    assert "exceeds the budget" in message and "30.00 GiB available" in message
    assert f"learner {plan.role('learner').bytes / GiB:.2f} GiB" in message
    assert "hyper_parameters.lora" in message


@pytest.mark.parametrize("available_gib", [30, 16])
def test_every_suggestion_fits_when_applied(tmp_path: Path, available_gib: int) -> None:
    spec, _ = _oversized(tmp_path)
    budget = Budget("cpu", 64 * GiB, available_gib * GiB)
    plan = plan_memory(spec, 512, budget)
    assert plan.suggestions
    for suggestion in plan.suggestions:
        applied = plan_memory(apply_suggestion(spec, suggestion.changes), 512, budget)
        assert applied.fits, suggestion
        assert applied.total_bytes == suggestion.total_bytes
    if available_gib == 16:  # no single change is enough: the learner's changes together
        assert len(plan.suggestions[0].changes) > 1


def test_with_nothing_that_fits_the_error_names_the_largest_role_field(tmp_path: Path) -> None:
    spec, _ = _oversized(tmp_path)
    with pytest.raises(ConfigError, match="none of the changes tried") as refused:
        check_memory_plan(spec, 512, Budget("cpu", 64 * GiB, 4 * GiB))
    assert refused.value.field == "hyper_parameters.lora"


def test_per_device_budget_refuses_a_learner_that_exceeds_its_gpu(tmp_path: Path) -> None:
    spec, _ = _oversized(tmp_path)
    small_gpu = Budget("cuda", 256 * GiB, 256 * GiB, device_bytes=8 * GiB)
    plan = plan_memory(spec, 512, small_gpu)
    assert not plan.fits and any(line.startswith("learner") for line in plan.over)
    # Offload and more ranks under ZeRO-3 are what a GPU plan can use.
    for suggestion in plan.suggestions:
        assert plan_memory(apply_suggestion(spec, suggestion.changes), 512, small_gpu).fits
    # A GPU whose size this process cannot see is not checked.
    unknown = Budget("cuda", 256 * GiB, 256 * GiB, device_bytes=None)
    assert plan_memory(spec, 512, unknown).fits


def test_role_errors_are_relative_per_role_both_name() -> None:
    errors = role_errors({"learner": 120, "student": 90, "teacher": 50}, {"learner": 100, "student": 100})
    assert errors == pytest.approx({"learner": 0.2, "student": -0.1})
    assert role_errors({"learner": 1}, {"learner": 0, "driver": 5}) == {}


def test_a_weights_file_with_a_forged_header_length_is_a_config_error(tmp_path: Path) -> None:
    """A tenant's file claiming an exabyte header is refused by safetensors' bounded reader, naming
    `model`, instead of the server trying to read (or allocate) it."""
    folder = _model(tmp_path / "forged", with_weights=False)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 2**60) + b"{}")
    with pytest.raises(ConfigError) as caught:
        safetensors_parameters(folder)
    assert caught.value.field == "model" and "model.safetensors" in caught.value.message
