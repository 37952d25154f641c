"""`hyper_parameters.lora` in the job spec and its pre-flight (`jobspec/lora_check.py`), and the rank a
student engine serves (`engine/adapters.served_rank`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from opd_trainer.engine.adapters import served_rank
from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.job_spec import DEFAULT_LORA_TARGETS, HyperParameters, Resources
from opd_trainer.jobspec.lora_check import check_lora_targets, decoder_linear_modules, weight_names


def _model_folder(tmp_path: Path, *, sharded: bool = False) -> Path:
    """A folder with a decoder's weight names (tiny tensors: only the names are read)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for layer in range(2):
        prefix = f"model.layers.{layer}"
        names += [f"{prefix}.input_layernorm.weight", f"{prefix}.post_attention_layernorm.weight"]
        names += [f"{prefix}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        names += [f"{prefix}.self_attn.q_proj.bias"]
        names += [f"{prefix}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    tensors = {name: torch.zeros(1) for name in names}
    if sharded:
        half = len(names) // 2
        parts = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
        for file, part in parts.items():
            save_file({n: tensors[n] for n in part}, str(tmp_path / file))
        weight_map = {n: file for file, part in parts.items() for n in part}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_lora_is_off_by_default_and_named_as_peft() -> None:
    hp = HyperParameters()
    assert hp.lora is None and hp.lora_targets() is None
    hp = HyperParameters.model_validate({"lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.05}})
    assert hp.lora is not None and hp.lora.r == 8 and hp.lora.lora_alpha == 16
    assert hp.lora_targets() == list(DEFAULT_LORA_TARGETS)


@pytest.mark.parametrize(
    ("lora", "field"),
    [
        ({"r": 0}, "r"),
        ({"r": 8, "target_modules": []}, "target_modules"),
        ({"r": 8, "lora_dropout": 1.0}, "lora_dropout"),
        ({"r": 8, "rank": 8}, "rank"),  # not PEFT's name: refused, never ignored
    ],
)
def test_bad_lora_settings_name_the_field(lora: dict, field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        HyperParameters.model_validate({"lora": lora})
    assert any(error["loc"][:2] == ("lora", field) for error in caught.value.errors())


def test_optimizer_offload_needs_zero_2_or_3() -> None:
    assert Resources(zero_stage=2, optimizer_offload=True).optimizer_offload
    with pytest.raises(ValidationError, match="optimizer_offload needs zero_stage 2 or 3"):
        Resources(zero_stage=1, optimizer_offload=True)


@pytest.mark.parametrize("sharded", [False, True])
def test_weight_names_come_from_the_headers(tmp_path: Path, sharded: bool) -> None:
    names = weight_names(str(_model_folder(tmp_path, sharded=sharded)))
    assert "model.layers.1.mlp.down_proj.weight" in names and len(names) == 3 + 2 * 10
    modules = decoder_linear_modules(names)
    assert "model.layers.0.self_attn.q_proj" in modules
    assert not any("layernorm" in m or "embed" in m for m in modules)


def test_targets_the_student_has_pass(tmp_path: Path) -> None:
    folder = str(_model_folder(tmp_path))
    check_lora_targets(list(DEFAULT_LORA_TARGETS), folder)
    check_lora_targets(["self_attn.q_proj", "model.layers.0.mlp.up_proj"], folder)


@pytest.mark.parametrize(
    ("target", "reason"),
    [("c_attn", "is not a module of the student"), ("embed_tokens", "is not a layer of the decoder")],
)
def test_a_target_the_student_lacks_is_refused_naming_the_field(
    tmp_path: Path, target: str, reason: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        check_lora_targets(["q_proj", target], str(_model_folder(tmp_path)))
    assert caught.value.field == "hyper_parameters.lora.target_modules"
    assert reason in caught.value.message and "q_proj" in caught.value.message


def test_the_served_rank_is_the_smallest_vllm_takes() -> None:
    assert [served_rank(r) for r in (1, 2, 8, 9, 16, 100, 256)] == [1, 8, 8, 16, 16, 128, 256]
    with pytest.raises(ValueError, match="exceeds"):
        served_rank(1000)
