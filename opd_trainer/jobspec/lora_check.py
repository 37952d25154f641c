"""Pre-flight of `hyper_parameters.lora`: the student has every target module, as a linear layer of its
decoder, and vLLM can serve adapters for its architecture.

Refused here, naming the field, rather than inside PEFT (a target it cannot find) or vLLM (a model
class without LoRA support, an adapter on a layer it does not wrap) once the engines have started.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.memory_plan import safetensors_header

TARGETS_FIELD = "hyper_parameters.lora.target_modules"


def weight_names(model_path: str) -> list[str]:
    """The tensor names of a Hugging Face folder's safetensors weights (headers only, nothing loaded)."""
    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return sorted(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"cannot read {index.name}: {exc}", field="model") from None
    return sorted(name for file in sorted(folder.glob("*.safetensors")) for name in safetensors_header(file))


def decoder_linear_modules(names: list[str]) -> set[str]:
    """Modules inside the decoder's layers that hold a `weight` (the layers vLLM wraps with adapters);
    norms are excluded by their names."""
    return {
        name.removesuffix(".weight")
        for name in names
        if name.endswith(".weight") and ".layers." in name and "norm" not in name.rsplit(".", 2)[-2]
    }


def check_lora_targets(target_modules: list[str], model_path: str, field: str = TARGETS_FIELD) -> None:
    """Each target names (as PEFT matches: the full module name or its last parts) a linear module in
    the student's decoder layers; raises `ConfigError` naming `field` otherwise."""
    names = weight_names(model_path)
    if not names:
        return  # no safetensors weights to read: PEFT reports a missing module when the learner starts
    decoder = decoder_linear_modules(names)
    everything = {name.removesuffix(".weight") for name in names if name.endswith(".weight")}
    available = sorted({module.rsplit(".", 1)[-1] for module in decoder})
    for target in target_modules:
        in_decoder = any(m == target or m.endswith(f".{target}") for m in decoder)
        if in_decoder:
            continue
        elsewhere = any(m == target or m.endswith(f".{target}") for m in everything)
        reason = (
            "is not a layer of the decoder (vLLM serves adapters on the decoder's linear layers only)"
            if elsewhere
            else "is not a module of the student"
        )
        raise ConfigError(
            f"target module {target!r} {reason}; the student's decoder layers have: {', '.join(available)}",
            field=field,
        )


def check_lora_architecture(model_path: str, field: str = "hyper_parameters.lora") -> None:
    """vLLM can serve LoRA adapters for the student's architecture (`config.json` `architectures`).
    Needs vLLM importable here (the job server's image, a training box); where it is not, the student
    engine refuses at start instead."""
    config = Path(model_path) / "config.json"
    if not config.is_file() or importlib.util.find_spec("vllm") is None:
        return
    architectures = json.loads(config.read_text()).get("architectures") or []
    for architecture in architectures:
        supported = _vllm_serves_lora(architecture)
        if supported is False:
            raise ConfigError(
                f"vLLM cannot serve LoRA adapters for {architecture}: train every weight (no lora) or use a "
                "model family with LoRA support in vLLM (Llama, Qwen2/3, Mistral, Gemma, ...)",
                field=field,
            )


@functools.lru_cache(maxsize=32)
def _vllm_serves_lora(architecture: str) -> bool | None:
    """Whether vLLM's class for `architecture` supports LoRA (None: vLLM does not know it). Imports
    vLLM's model registry (~8 s the first time in a process), so only LoRA jobs pay it."""
    from vllm.model_executor.models.interfaces import supports_lora
    from vllm.model_executor.models.registry import ModelRegistry

    model_class = ModelRegistry._try_load_model_cls(architecture)
    return None if model_class is None else bool(supports_lora(model_class))


def preflight_lora(target_modules: list[str] | None, model_path: str) -> None:
    """Both checks for a LoRA job (`target_modules` None: not a LoRA job, nothing to check)."""
    if target_modules is None:
        return
    check_lora_targets(target_modules, model_path)
    check_lora_architecture(model_path)
