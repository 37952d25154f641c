"""A LoRA checkpoint where a whole model is needed (`learner/merged_models.py`): merged once into a
folder beside it, reused after, and a plain model folder passed through."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Qwen2Config

from opd_trainer.learner.merged_models import is_adapter_folder, merged_folder, whole_model


def _base(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    folder = tmp_path / "base"
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    return folder


def _adapter(base: Path, folder: Path) -> Any:
    model = AutoModelForCausalLM.from_pretrained(str(base))
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    peft_model.peft_config["default"].base_model_name_or_path = str(base)
    peft_model.save_pretrained(str(folder))
    return peft_model


def test_an_adapter_checkpoint_becomes_its_merged_model_once(tmp_path: Path) -> None:
    base = _base(tmp_path)
    adapter = tmp_path / "ckpt" / "student"
    peft_model = _adapter(base, adapter)
    assert is_adapter_folder(adapter) and not is_adapter_folder(base)

    merged = Path(whole_model(str(adapter)))
    assert merged == adapter.with_name("student-merged") and not is_adapter_folder(merged)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    loaded = AutoModelForCausalLM.from_pretrained(str(merged))
    with torch.no_grad():
        expected = peft_model(ids).logits
        assert torch.allclose(loaded(ids).logits, expected, atol=1e-5)
    # Made once: a second call finds it (no new folder, same files), and nothing half-made is left.
    made = (merged / "config.json").stat().st_mtime_ns
    assert merged_folder(adapter) == merged and (merged / "config.json").stat().st_mtime_ns == made
    assert sorted(p.name for p in adapter.parent.iterdir()) == ["student", "student-merged"]
    # A whole model is used as it is.
    assert whole_model(str(base)) == str(base)
