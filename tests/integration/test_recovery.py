"""A job survives losing its parts mid-job: each fault a real SIGKILL of the part's process (what an
OOM kill or a crashed CUDA context looks like), injected while the job runs; the driver restarts the
job's parts and resumes from the latest checkpoint, and the job ends with its steps continuous.

One job takes three faults in turn (start-ups are the cost: ~30 s each on 2 cores): the student
engine, then a learner rank of a two-rank learner, then the teacher engine that hosts the recording
gateways. A fourth kind of loss, beyond `resources.max_recoveries`, fails the job naming the field.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray

from opd_trainer.cluster.preemption import withdraw_notice
from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.demo.tiny_models.serving import TINY_KV_CACHE_BYTES
from opd_trainer.driver.job_driver import JobDriver
from opd_trainer.driver.local_run import train_spec
from opd_trainer.driver.recovery import RecoveryLog
from opd_trainer.errors import OPDError
from opd_trainer.jobspec.job_spec import JobSpec, parse_job_spec
from opd_trainer.jsonl import read_jsonl, write_jsonl
from opd_trainer.storage.run_dir import RunDir

pytestmark = pytest.mark.integration

JOB_TIMEOUT_S = 900


def _job(
    tiny_models: TinyModels,
    tmp_path: Path,
    steps: int,
    max_recoveries: int | None = None,
    save_steps: int = 2,
    eval_steps: int = 100,
) -> JobSpec:
    validation = tmp_path / "validation.jsonl"
    write_jsonl(validation, read_jsonl(tiny_models.data_dir / "validation.jsonl")[:8])
    engine = {"kv_cache_memory_bytes": TINY_KV_CACHE_BYTES, "dtype": "float32"}
    resources: dict[str, Any] = {"student": engine, "teacher": engine, "learner_gpus": 2}
    if max_recoveries is not None:
        resources["max_recoveries"] = max_recoveries
    return parse_job_spec(
        {
            "job_name": "recovers",
            "model": str(tiny_models.student),
            "teacher_model": str(tiny_models.teacher),
            "training_datasets": [str(tiny_models.data_dir / "train.jsonl")],
            "validation_datasets": [str(validation)],
            "hyper_parameters": {
                "max_steps": steps,
                "learning_rate": 1e-3,
                "lr_scheduler_type": "constant",
                "batch_size": 2,
                "n_rollouts": 2,
                "ppo_mini_batch_size": 4,
                "max_length": 1024,
                "max_tokens": 16,
                "eval_steps": eval_steps,
                "save_steps": save_steps,
                "seed": 0,
            },
            "resources": resources,
            "report_to": [],
        }
    )


def _pid_of(driver: Any, part: str) -> int:
    """The process id of the job part the driver calls `part` (e.g. "learner rank 1")."""
    held = ray.get(driver.__ray_call__.remote(lambda d: d._held_actors()))
    return int(ray.get(held[part].__ray_call__.remote(lambda _: os.getpid())))


class Faults(threading.Thread):
    """Kills `plan[i]` (a part's name) with SIGKILL once the job has had i recoveries and recorded
    training step `after[i]`; what it killed, in order, in `killed`."""

    def __init__(self, driver: Any, run_dir: Path, plan: list[tuple[int, str]]) -> None:
        super().__init__(daemon=True)
        self.driver, self.run_dir, self.plan = driver, run_dir, plan
        self.killed: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        recoveries = RecoveryLog(self.run_dir)
        while not self.done.is_set() and len(self.killed) < len(self.plan):
            after, part = self.plan[len(self.killed)]
            steps = [r["step"] for r in RunDir(self.run_dir).records() if r["kind"] == "train"]
            if len(recoveries.entries()) == len(self.killed) and steps and max(steps) >= after:
                try:
                    os.kill(_pid_of(self.driver, part), signal.SIGKILL)
                    self.killed.append(part)
                except Exception:  # the parts are restarting: ask again
                    pass
            time.sleep(0.05)


def _run_with_faults(spec: JobSpec, run_dir: Path, plan: list[tuple[int, str]]) -> tuple[Any, Faults]:
    driver = ray.remote(JobDriver).options(num_cpus=0).remote(spec, str(run_dir))
    faults = Faults(driver, run_dir, plan)
    faults.start()
    try:
        return ray.get(driver.run.remote(), timeout=JOB_TIMEOUT_S), faults
    finally:
        faults.done.set()
        ray.kill(driver)


def test_a_job_survives_losing_an_engine_a_learner_rank_and_the_gateway_host(
    ray_session: None, tiny_models: TinyModels, tmp_path: Path
) -> None:
    spec, run_dir = _job(tiny_models, tmp_path, steps=6, eval_steps=2), tmp_path / "run"
    # The last fault lands as step 4 is validated and checkpointed: a validation lost to it is redone.
    plan = [(1, "student engine replica 0"), (3, "learner rank 1"), (4, "teacher engine replica 0")]
    summary, faults = _run_with_faults(spec, run_dir, plan)

    assert faults.killed == [part for _, part in plan]
    run = RunDir(run_dir)
    recoveries = [e for e in run.events() if e.type == "recovery"]
    assert [e.data["lost"][0]["name"] for e in recoveries] == faults.killed, recoveries
    assert all(e.data["recovery"] == n for n, e in enumerate(recoveries, start=1))
    # Every step once, in order: the steps after each resumed checkpoint were redone, not doubled.
    assert [r["step"] for r in run.records() if r["kind"] == "train"] == list(range(1, 7))
    evaluated = [r["step"] for r in run.records() if r["kind"] == "eval"]
    assert evaluated == [0, 2, 4, 6], evaluated  # each validation once
    resumed = [e for e in run.events() if e.message.startswith("resumed from checkpoint")]
    assert len(resumed) >= 2, resumed  # the learner's loss at least resumes from the step-2 checkpoint
    assert run.latest_checkpoint_id() is not None and summary["student_after"]["reverse_kl"] >= 0
    assert [r.step for r in RecoveryLog(run_dir).entries()] == [e.data["step"] for e in recoveries]


def test_a_loss_beyond_max_recoveries_fails_the_job_naming_the_field(
    ray_session: None, tiny_models: TinyModels, tmp_path: Path
) -> None:
    spec, run_dir = _job(tiny_models, tmp_path, steps=3, max_recoveries=0), tmp_path / "run"
    with pytest.raises(OPDError) as raised:
        _run_with_faults(spec, run_dir, [(1, "student engine replica 0")])
    assert raised.value.field == "resources.max_recoveries", raised.value
    assert "student engine replica 0" in raised.value.message
    [error] = [e for e in RunDir(run_dir).events() if e.type == "error"]
    assert error.data["field"] == "resources.max_recoveries"


class LossAfterNotice(threading.Thread):
    """Once the job has checkpointed after its `preemption` event (the grace is over), the node's
    learner rank is lost."""

    def __init__(self, driver: Any, run_dir: Path) -> None:
        super().__init__(daemon=True)
        self.driver, self.run_dir = driver, run_dir
        self.killed = False
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set() and not self.killed:
            events = RunDir(self.run_dir).events() if self.run_dir.exists() else []
            noticed = [e.seq for e in events if e.type == "preemption"]
            if noticed and any(e.type == "checkpoint" and e.seq > noticed[0] for e in events):
                os.kill(_pid_of(self.driver, "learner rank 0"), signal.SIGKILL)
                self.killed = True
            time.sleep(0.05)


def test_a_preemption_notice_checkpoints_the_step_and_the_loss_resumes_from_it(
    ray_session: None, tiny_models: TinyModels, tmp_path: Path
) -> None:
    """No periodic checkpoint falls in this job: without the notice's, the learner's loss would send
    it back to the start."""
    spec, run_dir = _job(tiny_models, tmp_path, steps=8, save_steps=100), tmp_path / "run"
    # What a drained pod's preStop hook runs on the node (this machine's only node), posted before the
    # job starts so that however fast its steps, the first step boundary reads it.
    command = [sys.executable, "-m", "opd_trainer.cli", "preemption-notice", "--no-wait", "--grace-s", "30"]
    notice = subprocess.run(
        [*command, "--address", ray.get_runtime_context().gcs_address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert notice.returncode == 0, notice
    driver = ray.remote(JobDriver).options(num_cpus=0).remote(spec, str(run_dir))
    watcher = LossAfterNotice(driver, run_dir)
    watcher.start()
    try:
        ray.get(driver.run.remote(), timeout=JOB_TIMEOUT_S)
    finally:
        watcher.done.set()
        ray.kill(driver)
        withdraw_notice(ray.get_runtime_context().get_node_id())  # the session's other jobs: no notice

    assert watcher.killed
    events = RunDir(run_dir).events()
    [preemption] = [e for e in events if e.type == "preemption"]
    assert "learner rank 0" in preemption.data["parts"]
    [recovery] = [e for e in events if e.type == "recovery"]
    assert recovery.data["lost"][0]["name"] == "learner rank 0"
    assert recovery.data["resumes_from"] == preemption.data["step"] >= 1
    assert [r["step"] for r in RunDir(run_dir).records() if r["kind"] == "train"] == list(range(1, 9))


def _driver_processes() -> list[psutil.Process]:
    return [
        p
        for p in psutil.process_iter(["cmdline"])
        if (p.info["cmdline"] or [""])[0].startswith("ray::JobDriver")
    ]


def test_opd_train_starts_a_new_driver_when_its_driver_dies(
    ray_session: None, tiny_models: TinyModels, tmp_path: Path
) -> None:
    """`opd train`'s path (`train_spec`): the driver's process killed after step 2's checkpoint; a new
    driver resumes from it and the job ends with every step once."""
    spec, run_dir = _job(tiny_models, tmp_path, steps=6), tmp_path / "run"
    before = {p.pid for p in _driver_processes()}
    killed: list[int] = []
    done = threading.Event()

    def kill_driver() -> None:
        while not done.is_set() and not killed:
            new = [p for p in _driver_processes() if p.pid not in before]
            # This job's driver: the one new driver (another on the machine started since: wait).
            if RunDir(run_dir).checkpoint_store().latest_step() == 2 and len(new) == 1:
                new[0].kill()
                killed.append(new[0].pid)
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_driver, daemon=True)
    watcher.start()
    try:
        summary = train_spec(spec, run_dir)
    finally:
        done.set()
    assert killed and "student_after" in summary
    [entry] = RecoveryLog(run_dir).entries()
    assert entry.cause == "job driver" and entry.resumes_from == 2
    assert [r["step"] for r in RunDir(run_dir).records() if r["kind"] == "train"] == list(range(1, 7))


@pytest.fixture
def small_disk(tmpfs: Any) -> Path:
    """A 256 MiB file system for a run directory (`tmpfs` in tests/conftest.py)."""
    return tmpfs(256 * 1024 * 1024)


def test_a_full_disk_at_a_checkpoint_fails_naming_it_and_the_previous_one_resumes(
    ray_session: None, tiny_models: TinyModels, tmp_path: Path, small_disk: Path
) -> None:
    """Once a first checkpoint is written the disk is filled to 2 MiB short of full (small writes,
    metrics and events, still fit; a checkpoint does not): the next checkpoint fails the job with an
    error naming the file system and the bytes needed, not a lost part; with space freed the job
    resumes from the checkpoint before and ends."""
    spec, run_dir = _job(tiny_models, tmp_path, steps=6, save_steps=1), small_disk / "run"
    filler = small_disk / "filler"
    done = threading.Event()
    filled: list[int] = []  # the latest checkpoint once the disk was full: every later save fails

    def fill_after_first_checkpoint() -> None:
        while not done.is_set():
            latest = RunDir(run_dir).checkpoint_store().latest_step() if run_dir.exists() else None
            if latest is not None and latest >= 1:
                free = shutil.disk_usage(small_disk).free
                with filler.open("wb") as out:
                    for _ in range(max(0, free - 2 * 1024 * 1024) // (1024 * 1024)):
                        out.write(b"\0" * 1024 * 1024)
                filled.append(int(RunDir(run_dir).checkpoint_store().latest_step() or 0))
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=fill_after_first_checkpoint, daemon=True)
    watcher.start()
    driver = ray.remote(JobDriver).options(num_cpus=0).remote(spec, str(run_dir))
    try:
        with pytest.raises(OPDError) as raised:
            ray.get(driver.run.remote(), timeout=JOB_TIMEOUT_S)
    finally:
        done.set()
        ray.kill(driver)
    assert str(small_disk) in raised.value.message and "needs about" in raised.value.message, raised.value
    store = RunDir(run_dir).checkpoint_store()
    assert filled and store.latest_step() == filled[0] and not list(store.root.glob(".staging-*"))
    assert not RecoveryLog(run_dir).entries()  # a full disk is not a lost part

    filler.unlink()
    driver = ray.remote(JobDriver).options(num_cpus=0).remote(spec, str(run_dir))
    try:
        ray.get(driver.run.remote(), timeout=JOB_TIMEOUT_S)
    finally:
        ray.kill(driver)
    events = RunDir(run_dir).events()
    assert any(e.message.startswith(f"resumed from checkpoint at step {filled[0]}") for e in events)
    assert [r["step"] for r in RunDir(run_dir).records() if r["kind"] == "train"] == list(range(1, 7))
