"""What the benchmarks share: running one OPD job in-process on the local Ray, and writing results.

`run_job` starts a `JobDriverActor` exactly as `opd train` does and returns the job's metric records
and summary, with the wall time of the whole run and of its start-up (everything before step 1), and
each student validation's per-sample outcomes by step (`RunDir.validation_outcomes`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXAMPLE_JOB = Path("examples/model_opd_tiny/job.yaml")
REWARD_WORKSPACE = Path("examples/tool_routing_agentic/workspace")


@dataclass
class JobRun:
    """One finished job: its metrics.jsonl records, summary (teacher / student before / after) and times."""

    records: list[dict[str, Any]]
    summary: dict[str, Any]
    wall_s: float
    # Step -> the student validation's per-sample outcomes (`driver/validation.validation_outcomes`).
    outcomes: dict[int, list[dict[str, Any]]] = field(default_factory=dict)

    def outcomes_at(self, step: int) -> list[dict[str, Any]]:
        """The per-sample outcomes of the validation at `step` (empty where none ran)."""
        return self.outcomes.get(step, [])

    @property
    def train(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["kind"] == "train"]

    @property
    def evals(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["kind"] == "eval"]

    @property
    def train_s(self) -> float:
        """Seconds spent in training steps (evaluations and start-up excluded)."""
        return sum(r["time/step_s"] for r in self.train)

    def train_s_until(self, step: int) -> float:
        return sum(r["time/step_s"] for r in self.train if r["step"] <= step)

    def exact_match_curve(self) -> list[dict[str, float]]:
        """Validation points (step 0 = before training): exact match and cumulative training seconds."""
        return [
            {"step": r["step"], "exact_match": r["exact_match"], "train_s": self.train_s_until(r["step"])}
            for r in self.evals
        ]


def outcomes_by_step(
    records: list[dict[str, Any]], passes: list[dict[str, Any]]
) -> dict[int, list[dict[str, Any]]]:
    """Each student validation pass's outcomes (`RunDir.validation_outcomes`) under the step of its eval
    record, by the driver's labels: `student before` is step 0, `step N` step N, `student after` the last
    validated step. A pass redone after a recovery replaces the earlier one."""
    evals = [r["step"] for r in records if r["kind"] == "eval"]
    by_step: dict[int, list[dict[str, Any]]] = {}
    for found in passes:
        label = str(found.get("label") or "")
        if label == "student before":
            step = 0
        elif label == "student after" and evals:
            step = evals[-1]
        elif label.startswith("step ") and label[5:].isdigit():
            step = int(label[5:])
        else:
            continue
        by_step[step] = found["outcomes"]
    return by_step


def example_rewards() -> list[dict[str, Any]]:
    """The tool-routing example's two reward components (decision + arguments), for a Model OPD job."""
    workspace = str(REWARD_WORKSPACE.resolve())
    runtime = {"cpu": 0.25, "memory_size": 512, "concurrency": 64, "min_capacity": 1, "max_capacity": 1}
    return [
        {
            "name": "decision",
            "type": "reward",
            "fcmodel": {"zipdir": workspace, "classpath": "functions.reward.DecisionReward"},
            "weight": 0.5,
            "runtime": runtime,
        },
        {
            "name": "arguments",
            "type": "reward",
            "fcmodel": {"zipdir": workspace, "classpath": "functions.reward.ArgumentReward"},
            "weight": 0.5,
            "reward_metric_weight": {"destructive_penalty": 1.0},
            "runtime": runtime,
        },
    ]


def job_spec(
    job_file: Path = EXAMPLE_JOB, functions: list[dict[str, Any]] | None = None, **hyper: Any
) -> Any:
    """The example job with `hyper_parameters` overridden and `functions` added to its own components
    (the example's evaluator, which reports exact match); checkpoints only at the end."""
    from opd_trainer.jobspec.job_spec import load_job_spec

    spec = load_job_spec(job_file)
    data = spec.model_dump()
    data["hyper_parameters"].update(save_steps=10**6, **hyper)
    data["functions"] = [*data["functions"], *(functions or [])]
    # Re-validated, so overrides get the spec's checks and components their defaults.
    return type(spec).model_validate(data)


def run_job(spec: Any, keep_dir: Path | None = None) -> JobRun:
    """Runs `spec` to the end on the local Ray (started if needed) and returns what it logged."""
    import ray

    from opd_trainer.cluster.ray_runtime import init_ray
    from opd_trainer.driver.job_driver import JobDriverActor
    from opd_trainer.storage.run_dir import RunDir

    run_dir = keep_dir or Path(tempfile.mkdtemp(prefix="opd-bench-"))
    init_ray()
    started = time.perf_counter()
    driver = JobDriverActor.options(num_cpus=0).remote(spec, str(run_dir.resolve()))  # type: ignore[attr-defined]
    try:
        summary = ray.get(driver.run.remote())
    finally:
        ray.kill(driver)
    wall_s = time.perf_counter() - started
    log = RunDir(run_dir)
    records = log.records()
    outcomes = outcomes_by_step(records, log.validation_outcomes())
    if keep_dir is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    return JobRun(records, summary or {}, wall_s, outcomes)


CUDA_MAX_MODEL_LEN = 2048


def engine_config(model_dir: Path, device: str, kv_cache_bytes: int | None = None) -> Any:
    """The benchmarks' engine: the tiny CPU settings, or bf16 compiled on CUDA.

    On CUDA `kv_cache_bytes=None` lets vLLM size the cache from the GPU (the engine is alone there).
    """
    from opd_trainer.demo.tiny_models.serving import tiny_engine_config
    from opd_trainer.engine.vllm_engine import EngineConfig, EnginePlacement

    if device == "cpu":
        return tiny_engine_config(model_dir)
    return EngineConfig(
        model=str(model_dir),
        max_model_len=CUDA_MAX_MODEL_LEN,
        resources=EnginePlacement(kv_cache_memory_bytes=kv_cache_bytes, dtype="bfloat16"),
        enforce_eager=False,
    )


def add_device_argument(parser: argparse.ArgumentParser, cuda_engines: str) -> None:
    """`--device cpu|cuda`; `cuda_engines` says how the engines run on CUDA."""
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: the tiny models, float32, fixed KV cache; cuda: --models-dir from make_random_model.py, "
        f"bfloat16, compiled, {cuda_engines}",
    )


def check_device(parser: argparse.ArgumentParser, device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU (install the `gpu` extra on a GPU box)")


def write_json(path: Path, result: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def save_figure(fig: Any, path: Path) -> None:
    """Grid and legend on every axis, then the figure to `path` (PNG), closed."""
    import matplotlib.pyplot as plt

    for ax in fig.axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def learner_settings(
    model_path: str,
    *,
    zero_stage: int,
    distill_loss: str,
    teacher_top_k: int,
    total_updates: int,
    learning_rate: float = 1e-5,
    ratio_cap: float = 10.0,
    **overrides: Any,
) -> Any:
    """A `LearnerSettings` for one learner rank driven by a benchmark (no job spec): a constant learning
    rate, no reward, hindsight, preference or KL-to-initial terms; `overrides` sets any other field
    (`lora`, `gradient_checkpointing`, `optimizer_offload`)."""
    # Imported here: the benchmarks that only run jobs do not load the learner's modules.
    from opd_trainer.learner.estimators import DistillationSettings
    from opd_trainer.learner.settings import LearnerSettings

    return LearnerSettings(
        model_path=model_path,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        warmup_ratio=0.0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        total_updates=total_updates,
        temperature=1.0,
        kl_loss_coef=0.0,
        reward_coef=0.0,
        normalize_reward_by_std=False,
        hindsight_coef=0.0,
        turn_preference_coef=0.0,
        turn_preference_beta=0.1,
        zero_stage=zero_stage,
        seed=0,
        distillation=DistillationSettings(
            distill_loss=distill_loss,
            teacher_top_k=teacher_top_k,
            kl_coef=1.0,
            jsd_beta=0.5,
            ratio_cap=ratio_cap,
        ),
        **overrides,
    )
