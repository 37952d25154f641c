"""LoRA adapters on the student with PEFT: wrapping the loaded model, the adapter as a PEFT folder's
files (what vLLM's `LoRARequest` and `PeftModel.from_pretrained` load), and base + adapter merged into
a plain Hugging Face folder (`merged_model`, on request only: training and serving keep them apart).

Pure functions of a model and paths (no Ray, no DeepSpeed): the learner calls them on its module,
tests on a tiny random model. PEFT is imported where used: a job without `lora` never loads it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opd_trainer.weight_sync.adapters import ADAPTER_FILES

if TYPE_CHECKING:
    from opd_trainer.learner.settings import LoraAdapter


def with_adapter(model: Any, lora: LoraAdapter, base_path: str) -> Any:
    """`model` wrapped by PEFT with a fresh LoRA adapter: only the adapter's A and B matrices train
    (B starts at zero, so the wrapped model's outputs equal the base's until the first update).
    `base_path` is recorded as the adapter's `base_model_name_or_path`."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
        bias="none",
        base_model_name_or_path=base_path,
    )
    peft_model = get_peft_model(model, config)
    peft_model.peft_config["default"].base_model_name_or_path = base_path
    return peft_model


def adapter_files(peft_model: Any) -> dict[str, bytes]:
    """The adapter of `peft_model` as the files of a PEFT folder ({file name: bytes}), written by
    PEFT's own `save_pretrained` so that the key names are the ones its loaders and vLLM expect.
    Under ZeRO-3 the caller gathers the adapter's parameters around this call."""
    with tempfile.TemporaryDirectory(prefix="opd-adapter-") as directory:
        peft_model.save_pretrained(directory, safe_serialization=True)
        return {name: (Path(directory) / name).read_bytes() for name in ADAPTER_FILES}


def write_adapter_files(files: dict[str, bytes], directory: str | Path) -> Path:
    """Writes `adapter_files`' answer as a folder `PeftModel.from_pretrained` loads; returns it."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


def merged_model(adapter_dir: str | Path, out_dir: str | Path, base_path: str | None = None) -> Path:
    """Base model + the adapter in `adapter_dir`, merged (`merge_and_unload`) and saved as a plain
    Hugging Face folder in `out_dir` with the tokenizer: what `AutoModelForCausalLM` and an engine
    without LoRA support load. `base_path`: the base model (default: the adapter's
    `base_model_name_or_path`); the tokenizer is the adapter folder's if it holds one, else the base's.
    Loads in the dtype the base was saved in; costs one copy of the base model in memory."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    base = base_path or PeftConfig.from_pretrained(str(adapter_dir)).base_model_name_or_path
    if not base:
        raise ValueError(f"{adapter_dir} names no base model (base_model_name_or_path); pass base_path")
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto", trust_remote_code=False)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(out_dir))
    tokenizer_source = str(adapter_dir) if (adapter_dir / "tokenizer_config.json").is_file() else base
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, trust_remote_code=False)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
