"""The learner's LoRA adapter (PEFT), gradient checkpointing and optimizer offload, on a tiny random Qwen2
student in tmp_path: one DeepSpeed rank (CPU accelerator, gloo, world size 1), no Ray."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from learner_settings import learner_settings
from tiny_student import VOCAB, save_tiny_student

from opd_trainer.errors import WeightSyncError
from opd_trainer.learner.adapters import merged_model, write_adapter_files
from opd_trainer.learner.batch import logprobs_of_targets, pad_segments, prefix_plan, scored_logits
from opd_trainer.records import LLMCall

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is first imported

TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def student(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_student(tmp_path_factory.mktemp("student"))


def _segments() -> list[LLMCall]:
    generator = torch.Generator().manual_seed(1)

    def tokens(length: int) -> list[int]:
        return torch.randint(1, VOCAB, (length,), generator=generator).tolist()

    system = tokens(9)
    prompts = [system + tokens(4), system + tokens(6)]
    return [
        LLMCall(
            prompt_token_ids=prompts[group],
            completion_token_ids=(completion := tokens(length)),
            sampler_logprobs=[-2.0] * len(completion),
            teacher_logprobs=[-1.0] * len(completion),
            group_id=group,
            rollout_id=index,
        )
        for index, (group, length) in enumerate([(0, 3), (0, 7), (1, 5), (1, 2)])
    ]


def _learner(student: str, resources: dict[str, Any] | None = None, **hyper_parameters: Any) -> Any:
    from opd_trainer.learner.deepspeed_learner import Learner

    settings = learner_settings(resources=resources, model=student, learning_rate=1e-2, **hyper_parameters)
    learner = Learner(settings)
    learner.initialize()
    return learner


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 23]])


def test_lora_trains_the_adapter_alone_and_hands_it_over_as_peft_files(student: str, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32).eval()
    learner = _learner(student, lora={"r": 4, "lora_alpha": 8, "target_modules": TARGETS}, kl_loss_coef=0.5)
    module = learner._engine.module
    # r·(in + out) for every targeted linear layer.
    expected = sum(
        4 * (layer.in_features + layer.out_features)
        for name, layer in base.named_modules()
        if isinstance(layer, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS
    )
    assert sum(p.numel() for p in module.parameters() if p.requires_grad) == expected
    # B starts at zero: the adapted student is the base model.
    torch.testing.assert_close(_logits(module, IDS), _logits(base, IDS), rtol=0, atol=1e-6)

    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    metrics = learner.train_step([_segments()])
    assert metrics["kl_to_initial"] == pytest.approx(0.0, abs=1e-6)  # the adapter's first forward is the base
    changed = {name for name, p in module.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all("lora_" in name for name in changed)
    assert any("lora_B" in name for name in changed)
    second = learner.train_step([_segments()])
    assert second["kl_to_initial"] > 0  # the reference is the base with the adapter switched off

    files = learner.adapter_files()
    assert set(files) == {"adapter_config.json", "adapter_model.safetensors"}
    adapter_dir = write_adapter_files(files, tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32), str(adapter_dir)
    ).eval()
    assert loaded.peft_config["default"].base_model_name_or_path == student
    adapted = _logits(module, IDS)
    assert not torch.allclose(adapted, _logits(base, IDS), atol=1e-4)
    torch.testing.assert_close(_logits(loaded, IDS), adapted, rtol=0, atol=1e-6)

    merged_dir = merged_model(adapter_dir, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(merged, IDS), _logits(loaded, IDS), rtol=0, atol=1e-5)
    assert (merged_dir / "tokenizer_config.json").is_file()

    with pytest.raises(WeightSyncError, match="adapter_files"):
        learner.export_weights(["shm"])

    learner.save_checkpoint(str(tmp_path / "checkpoint"))
    saved = tmp_path / "checkpoint" / "student"
    assert (saved / "adapter_config.json").is_file() and (saved / "tokenizer_config.json").is_file()
    assert not (saved / "config.json").exists()  # the adapter, not a whole model
    learner.load_checkpoint(str(tmp_path / "checkpoint"))
    torch.testing.assert_close(_logits(module, IDS), adapted, rtol=0, atol=0)
    # The drift probe runs on the adapted student (eval mode, shared-prefix forward).
    assert len(learner.compute_logprobs(_segments())[1]) == 7


def _checkpointed_gradients(student: str, checkpointing: bool, with_plan: bool) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = pad_segments(_segments(), 0, "cpu")
    logits = scored_logits(model, batch, prefix_plan(batch) if with_plan else None, "cpu")
    loss = (logprobs_of_targets(logits, batch, 0.7) * batch.mask_B_T).sum()
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_checkpointed_gradients_equal_the_plain_and_the_shared_prefix_forwards(student: str) -> None:
    checkpointed = _checkpointed_gradients(student, checkpointing=True, with_plan=False)
    for reference in (
        _checkpointed_gradients(student, checkpointing=False, with_plan=False),
        _checkpointed_gradients(student, checkpointing=False, with_plan=True),
    ):
        for name, gradient in reference.items():
            torch.testing.assert_close(checkpointed[name], gradient, rtol=0, atol=1e-5, msg=name)


def test_a_checkpointing_learner_takes_the_plain_forward_and_updates_as_the_shared_prefix_one(
    student: str,
) -> None:
    plain = _learner(student)
    checkpointed = _learner(student, gradient_checkpointing=True)
    batch = pad_segments(_segments(), 0, "cpu")
    assert checkpointed._forward_plan(batch) is None and plain._forward_plan(batch) is not None
    layers = checkpointed._engine.module.model.layers
    assert checkpointed._engine.module.training and all(layer.gradient_checkpointing for layer in layers)
    plain_metrics = plain.train_step([_segments()])
    checkpointed_metrics = checkpointed.train_step([_segments()])
    assert checkpointed_metrics["loss"] == pytest.approx(plain_metrics["loss"], abs=1e-6)
    # One CPU rank runs ZeRO-0, where DeepSpeed keeps no norm: the learner's own, before clipping.
    assert plain_metrics["grad_norm"] > 0
    assert checkpointed_metrics["grad_norm"] == pytest.approx(plain_metrics["grad_norm"], rel=1e-5)


def test_optimizer_offload_steps_like_adamw(student: str) -> None:
    adamw = _learner(student, resources={"zero_stage": 2})
    assert adamw._zero_stage == 0  # ZeRO-2 has nothing to partition with one CPU rank
    offloaded = _learner(student, resources={"zero_stage": 2, "optimizer_offload": True})
    assert offloaded._zero_stage == 2
    for _ in range(2):
        adamw.train_step([_segments()])
        offloaded.train_step([_segments()])
    for (name, expected), (_, actual) in zip(adamw.named_weights(), offloaded.named_weights(), strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5, msg=name)
