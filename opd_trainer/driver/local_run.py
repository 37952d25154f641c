"""Running a job spec on an embedded local Ray (or `RAY_ADDRESS`) from this process, with a live progress
bar: `prepare_spec` (Hugging Face ids to local snapshots, the local pre-flight checks) and `train_spec`.
`opd train` (`opd_trainer/cli/train.py`) and `tune(...)` (`opd_trainer/tuner.py`) both run jobs this way.

Writes per-step metrics (JSONL + TensorBoard), events, checkpoints, PNG curves and a final
teacher / student-before / student-after table under the run directory. Re-running the same
spec resumes from the run directory's latest checkpoint.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import ray
from ray import ObjectRef
from ray.actor import ActorHandle
from ray.exceptions import RayActorError
from tqdm import tqdm

from opd_trainer.cluster.ray_runtime import init_ray
from opd_trainer.driver.plots import format_final_table, plot_curves
from opd_trainer.driver.recovery import DEFAULT_MAX_RECOVERIES, RecoveryLog
from opd_trainer.errors import OPDError
from opd_trainer.jobspec.dataset import load_samples
from opd_trainer.jobspec.job_spec import JobSpec
from opd_trainer.jobspec.lora_check import preflight_lora
from opd_trainer.jobspec.model_source import local_model
from opd_trainer.jobspec.preflight import check_references, check_task_records, preflight_models
from opd_trainer.learner.merged_models import whole_model
from opd_trainer.storage.run_dir import RunDir
from opd_trainer.storage.shared import write_probe
from opd_trainer.wire.driver import DriverEvent, DriverProgress, ValidationSummary

__all__ = ["preflight_local", "prepare_spec", "train_spec"]


def preflight_local(spec: JobSpec) -> None:
    """Cheap checks before anything starts: datasets parse, tokenizers match, max_length fits."""
    train = load_samples(spec.training_datasets, "training_datasets")
    check_references(train, spec.hyper_parameters.teacher_hindsight)
    check_task_records(train, "training_datasets", spec.is_agentic)
    if spec.validation_datasets:
        validation = load_samples(spec.validation_datasets, "validation_datasets")
        check_task_records(validation, "validation_datasets", spec.is_agentic)
    preflight_models(spec.hyper_parameters.max_length, spec.weight_sources())
    preflight_lora(spec.hyper_parameters.lora_targets(), spec.model)


async def _follow(driver: ActorHandle, run: ObjectRef) -> ValidationSummary:
    """Polls the driver for progress and events until `run` (its `run()`) finishes; returns its summary."""
    bar = tqdm(total=None, unit="step", dynamic_ncols=True)
    last_event = -1
    try:
        while True:
            done, _ = ray.wait([run], timeout=0)
            progress: DriverProgress
            events: list[DriverEvent]
            progress, events = await asyncio.gather(
                driver.progress.remote(), driver.events.remote(last_event)
            )
            for event in events:
                last_event = event.seq
                if event.type in {"eval", "checkpoint", "preflight", "error", "status"}:
                    bar.write(f"[{event.type}] {event.message}")
            if progress.total_steps and bar.total != progress.total_steps:
                bar.total = progress.total_steps  # known once the driver has read the datasets
                bar.refresh()
            if progress.step > bar.n:
                bar.update(progress.step - bar.n)
            metrics = progress.metrics
            if metrics:
                postfix = {}
                if "reverse_kl" in metrics:  # validation of task records alone reports none
                    postfix["KL"] = f"{metrics['reverse_kl']:.3f}"
                if "tokens_per_s" in metrics:
                    postfix["tok/s"] = f"{metrics['tokens_per_s']:.0f}"
                if "reward_mean" in metrics:
                    postfix["reward"] = f"{metrics['reward_mean']:.3f}"
                bar.set_postfix(postfix)
            if done:
                return await run
            await asyncio.sleep(0.5)
    finally:
        bar.close()


def prepare_spec(spec: JobSpec) -> JobSpec:
    """`spec` with Hugging Face ids turned into their snapshot folders (downloaded if missing, as the
    server resolves them) and LoRA checkpoints into their merged models, after the local pre-flight
    checks; raises `OPDError` naming the field."""
    spec = spec.with_weight_sources(
        {
            # A LoRA job's checkpoint (an adapter folder) trains and serves as its merged model.
            field: whole_model(local_model(value, field, download=True))
            for field, value in spec.weight_sources().items()
        }
    )
    preflight_local(spec)
    return spec


def _restart_or_raise(spec: JobSpec, run_dir: Path, exc: RayActorError) -> None:
    """After the job's driver died: returns when a new driver may resume the job from its latest
    checkpoint (within `resources.max_recoveries`, counted with the driver's own recoveries in the run
    directory), else raises `OPDError` naming the field."""
    log = RecoveryLog(run_dir)
    steps = [r["step"] for r in RunDir(run_dir).records() if r["kind"] == "train"]
    step = max(steps, default=0)
    budget = spec.resources.max_recoveries
    budget = DEFAULT_MAX_RECOVERIES if budget is None else budget
    refusal = log.refusal(step, "job driver", budget)
    if refusal is not None:
        raise OPDError(
            f"the job driver died at step {step + 1}; {refusal}", field="resources.max_recoveries"
        ) from exc
    latest = RunDir(run_dir).checkpoint_store().latest_step()
    count = log.add(step, "job driver", "the job driver died", latest)
    start = "the start" if latest is None else f"the checkpoint of step {latest}"
    print(f"[recovery] the job driver died; a new one resumes from {start} ", end="")
    print(f"(recovery {count} of at most {budget})")


def train_spec(
    spec: JobSpec, run_dir: Path | None = None, stop_after: int | None = None
) -> ValidationSummary:
    """Runs a prepared `spec` on the local (or `RAY_ADDRESS`) Ray cluster with progress on the terminal;
    returns the job's summary. Raises `OPDError` when the job fails."""
    # The driver actor's module imports torch, vLLM and DeepSpeed: loaded when a job starts, not when
    # the CLI or `opd_trainer.tuner` is imported.
    from opd_trainer.driver.job_driver import JobDriverActor

    run_dir = run_dir or Path("runs") / spec.job_name
    print(f"job {spec.job_name}: run directory {run_dir} (re-run to resume from its latest checkpoint)")
    started = time.perf_counter()
    init_ray()
    token = write_probe(run_dir.resolve())  # on a cluster, the driver's and learner's nodes must see it
    while True:
        driver = JobDriverActor.options(num_cpus=0).remote(  # type: ignore[attr-defined]
            spec, str(run_dir.resolve()), "local", token
        )
        try:
            summary = asyncio.run(_follow(driver, driver.run.remote(stop_after)))
            break
        except RayActorError as exc:  # the driver died: its engines, ranks and pools died with it
            _restart_or_raise(spec, run_dir, exc)
        finally:
            ray.kill(driver)
    records = RunDir(run_dir).records()
    if records:
        print(f"curves: {plot_curves(records, run_dir / 'curves.png', spec.job_name)}")
    where = [f"metrics: {run_dir / 'metrics.jsonl'}"]
    if "tensorboard" in spec.report_to:
        where.append(f"tensorboard: {run_dir / 'tensorboard'}")
    if "mlflow" in spec.report_to:
        run_id_path = RunDir(run_dir).mlflow_run_id_path
        where.append(f"mlflow run: {run_id_path.read_text().strip() if run_id_path.is_file() else '-'}")
    print("  ".join(where))
    if summary:
        print(format_final_table(summary))
    print(f"finished in {time.perf_counter() - started:.0f}s")
    return summary
