"""Jobs that really train, submitted over HTTP: real `opd serve`, real SQLite file, real Ray, vLLM, DeepSpeed.

1. One Model OPD job through the Python client, followed over the event stream to `succeeded`, with
   its events, metrics, trajectories and a checkpoint (a Hugging Face student) retrievable.
2. The server process is SIGKILLed (with its embedded Ray) while the job trains and started again on
   the same data dir: it reconciles the job, resumes it from its latest checkpoint, and the job still
   reaches `succeeded` with every step's metrics recorded once and no driver event lost.

3. Two servers on one PostgreSQL database and data dir: the one holding the scheduler lease is
   SIGKILLed mid-job and the standby takes over, resumes the job and finishes it.
4. A driver that fails (here: a model folder with a tokenizer but no weights) fails its job with the
   driver's reason, and the server keeps scheduling.

1 to 3 need the tiny models (`opd make-tiny-models .cache/tiny-models`): several minutes each on 2
CPU cores; 3 also a PostgreSQL server (tests/api/postgres_server.py). 4 needs only Ray.

1, 2 and 4 run on the session's shared training server (`training_server`, tests/conftest.py): one
server start for them all (2 kills it and starts it again on the same data dir, as it did its own).
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from apiserver import (
    ADMIN_KEY,
    TINY_MODELS_DIR,
    Server,
    cancel_unfinished,
    create_key,
    jsonl,
    make_tokenizer,
    record,
    wait_for_job,
)

from opd_trainer.client import OPDClient, StreamEnd
from opd_trainer.wire.schemas import EventPublic, JobPublic

if TYPE_CHECKING:
    from opd_trainer.demo.tiny_models import TinyModels

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

ENGINE = {"kv_cache_memory_bytes": 134217728, "dtype": "float32"}


def _subset(source: Path, target: Path, count: int) -> str:
    lines = [line for line in source.read_text().splitlines() if line.strip()][:count]
    target.write_text("\n".join(lines) + "\n")
    return str(target)


def _run_args(tiny_models: TinyModels, tmp_path: Path, max_steps: int, save_steps: int) -> dict[str, Any]:
    return {
        "job_name": f"api-e2e-{max_steps}",
        "model": str(tiny_models.student),
        "teacher_model": str(tiny_models.teacher),
        "training_datasets": [str(tiny_models.data_dir / "train.jsonl")],
        "validation_datasets": [
            _subset(tiny_models.data_dir / "validation.jsonl", tmp_path / "val.jsonl", 8)
        ],
        "hyper_parameters": {
            "max_steps": max_steps,
            "learning_rate": 1e-3,
            "lr_scheduler_type": "constant",
            "batch_size": 4,
            "n_rollouts": 2,
            "ppo_mini_batch_size": 8,
            "max_length": 1024,
            "max_tokens": 32,
            "eval_steps": 100,
            "save_steps": save_steps,
            "seed": 0,
        },
        "resources": {"student": ENGINE, "teacher": ENGINE, "learner_gpus": 0},
    }


def _followed(client: OPDClient, job_id: str) -> tuple[list[EventPublic], StreamEnd]:
    """The job's events over the stream until it ends, and the end (the finished job)."""
    *events, end = client.stream_events(job_id)
    assert isinstance(end, StreamEnd), end
    return [e for e in events if isinstance(e, EventPublic)], end  # all of them: only the last ends


def _dump(events: list[EventPublic]) -> str:
    return json.dumps([e.model_dump(mode="json") for e in events], indent=1)


def _assert_same_model(downloaded: Path, on_server: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours, theirs = (AutoModelForCausalLM.from_pretrained(str(p)) for p in (downloaded, on_server))
    assert (
        AutoTokenizer.from_pretrained(str(downloaded)).vocab
        == AutoTokenizer.from_pretrained(str(on_server)).vocab
    )
    expected = theirs.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_job_over_http_succeeds_with_events_metrics_and_checkpoint(
    trained_models: TinyModels, tmp_path: Path, training_server: Server
) -> None:
    tiny_models = trained_models
    server = training_server
    client = OPDClient(server.url, create_key(server.url, "e2e"))
    job_id = None
    try:
        job_id = client.run(**_run_args(tiny_models, tmp_path, max_steps=3, save_steps=2))
        events, end = _followed(client, job_id)
        final = end.job
        assert final is not None and final.status == "succeeded", server.log() + _dump(events[-5:])
        types = [e.type for e in events]
        steps = [e.data["step"] for e in events if e.type == "step"]
        assert steps == [1, 2, 3] and "checkpoint" in types and "eval" in types
        assert final.step == 3 and final.total_steps == 3 and "reverse_kl" in final.metrics

        metrics = client.metrics(job_id)
        assert [r["step"] for r in metrics.data if r["kind"] == "train"] == [1, 2, 3]
        assert {"teacher", "student_before", "student_after"} <= metrics.summary.keys()
        checkpoints = client.checkpoints(job_id)
        assert [c.step for c in checkpoints] == [2, 3]
        # Named by the job's id (no server path); the folder is under the server's runs.
        assert checkpoints[-1].student == f"{job_id}/checkpoints/{checkpoints[-1].id}/student"
        on_server = server.data_dir.resolve() / "runs" / checkpoints[-1].student
        assert (on_server / "config.json").is_file()
        assert final.fine_tuned_model == checkpoints[-1].id and final.trained_tokens > 0
        step_3 = next(r for r in metrics.data if r["kind"] == "train" and r["step"] == 3)
        assert checkpoints[-1].metrics["reverse_kl"] == step_3["reverse_kl"]
        # The trained student comes out as a model folder transformers loads, weights as trained.
        downloaded = client.download_checkpoint(job_id, target=tmp_path / "trained-student")
        _assert_same_model(downloaded, on_server)
        trajectories = client.trajectories(job_id, limit=4)
        assert len(trajectories) == 4 and all("messages" in t for t in trajectories)
        assert "[checkpoint] saved step 3" in client.logs(job_id)
        # Metering: the job's usage, the tenant's total (kept after the job is deleted) and the
        # admin's Prometheus series of it.
        usage = final.usage
        assert usage["teacher_tokens"] > 0 and usage["learner_tokens_trained"] == final.trained_tokens
        assert usage["cpu_s/teacher_engines"] > 0 and usage["wall_s"] > 0
        [mine] = client.usage()
        assert mine.tenant == "e2e" and mine.jobs == 1 and mine.usage == pytest.approx(usage)
        client.delete_job(job_id)
        [mine] = client.usage()
        assert mine.jobs == 0 and mine.usage == pytest.approx(usage)
        scrape = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
        line = next(
            x for x in scrape.splitlines() if x.startswith('opd_tenant_teacher_tokens_total{tenant="e2e"}')
        )
        assert float(line.split()[-1]) == pytest.approx(usage["teacher_tokens"])
        assert "opd_tenant_" not in httpx.get(server.url + "/metrics").text  # only with the admin key
    finally:
        cancel_unfinished(client, job_id)


def test_server_killed_mid_job_resumes_and_the_job_succeeds(
    trained_models: TinyModels, tmp_path: Path, training_server: Server
) -> None:
    tiny_models = trained_models
    server = training_server
    key = create_key(server.url, "restart")
    client = OPDClient(server.url, key)
    job_id = None
    try:
        job_id = client.run(**_run_args(tiny_models, tmp_path, max_steps=5, save_steps=1))
        wait_for_job(client, job_id, lambda j: j.step >= 2, timeout_s=900)
        server.kill()  # SIGKILL: no shutdown hook runs, and the embedded Ray dies with the server

        server.start(ready_timeout=300, wait_ready=True)
        final = wait_for_job(client, job_id, lambda j: j.status in ("succeeded", "failed", "cancelled"), 900)
        assert final.status == "succeeded", server.log()
        events = client.events(job_id, limit=1000).data
        messages = [e.message for e in events]
        assert any("server restarted" in m for m in messages)
        assert any(m.startswith("resumed from checkpoint at step") for m in messages)
        # Every step's event reached the database at least once (steps after the checkpoint are redone).
        step_events = Counter(e.data["step"] for e in events if e.type == "step")
        assert set(step_events) == {1, 2, 3, 4, 5}
        # A step event seen twice belongs to a step the resume discarded, and the resume says so.
        discarded = {s for e in events for s in e.data.get("discarded_steps", [])}
        assert {step for step, count in step_events.items() if count > 1} <= discarded
        metrics = client.metrics(job_id).data
        assert [r["step"] for r in metrics if r["kind"] == "train"] == [1, 2, 3, 4, 5]
        assert [c.step for c in client.checkpoints(job_id)] == [1, 2, 3, 4, 5]
        # Trajectories of discarded steps are gone: every step has one batch (4 prompts x 2 rollouts).
        per_step = Counter(t["step"] for t in client.trajectories(job_id, limit=200))
        assert per_step == {step: 8 for step in (1, 2, 3, 4, 5)}
    finally:  # the next test gets the server running, without this job (were it left unfinished)
        if server.process is None or server.process.poll() is not None:
            server.start(ready_timeout=300, wait_ready=True)
        cancel_unfinished(client, job_id)


def test_a_dry_run_calibrates_and_estimates_the_whole_job(
    trained_models: TinyModels,
    tmp_path: Path,
    training_server: Server,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`opd submit --dry-run --follow` (the CLI, over HTTP): the server runs the job's first 2 steps
    as a calibration and the finished job's `dry_run.estimate` scales them to its 6 steps; no model."""
    from opd_trainer.cli.main import main

    monkeypatch.setenv("OPD_BASE_URL", training_server.url)
    monkeypatch.setenv("OPD_API_KEY", create_key(training_server.url, "dry-run"))
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(_run_args(trained_models, tmp_path, max_steps=6, save_steps=100)))
    assert (
        main(["submit", str(job_file), "--dry-run", "--follow", "-o", "json", "--plot-dir", str(tmp_path)])
        == 0
    )
    out, notes = capsys.readouterr()
    job = JobPublic.model_validate_json(out)
    assert job.status == "succeeded" and job.step == 2 and job.total_steps == 2
    assert job.dry_run is not None and (job.dry_run.calibration_steps, job.dry_run.total_steps) == (2, 6)
    assert job.fine_tuned_model is None and job.best_checkpoint is None
    found = job.dry_run.estimate
    assert found is not None and (found["total_steps"], found["validations"]) == (6, 1)
    # start + first step + 5 steady steps + the final validation, per metered key; more than the
    # calibration (2 steps, 2 validations of the trained student) used itself.
    for key in ("teacher_tokens", "learner_tokens_trained", "wall_s"):
        parts = (
            found["start"][key] + found["first_step"][key] + 5 * found["step"][key] + found["validation"][key]
        )
        assert found["usage"][key] == pytest.approx(parts)
    assert found["usage"]["learner_tokens_trained"] > job.usage["learner_tokens_trained"] > 0
    assert "estimate for api-e2e-6: 6 steps, 1 validations (from 2 calibration steps)" in notes


def test_a_failing_driver_fails_its_job_with_the_reason(tmp_path: Path, training_server: Server) -> None:
    server = training_server
    tokenizer_only = str(make_tokenizer(server.model_dirs[-1] / f"no-weights-{uuid.uuid4().hex[:8]}"))
    client = OPDClient(server.url, create_key(server.url, "failing"))
    job_id = None
    try:
        assert server_ready_checks(server)["ray"] == "ok"
        (tmp_path / "train.jsonl").write_bytes(jsonl([record("hello world")] * 4))
        job_id = client.run(
            job_name="no-weights",
            model=tokenizer_only,
            teacher_model=tokenizer_only,
            training_datasets=[str(tmp_path / "train.jsonl")],
            hyper_parameters={"max_steps": 1, "batch_size": 2},
            resources={"student": ENGINE, "teacher": ENGINE, "learner_gpus": 0},
        )
        events, end = _followed(client, job_id)
        final = end.job
        assert final is not None and final.status == "failed", final
        assert final.error is not None and final.error.code == "job_failed", final
        assert final.error.message and "\x1b[" not in final.error.message
        types = [e.type for e in events]
        assert types.count("error") == 1 and "status" in types
        assert [e.data["status"] for e in events if e.type == "status" and "status" in e.data][-1] == "failed"
    finally:
        cancel_unfinished(client, job_id)


def test_a_standby_replica_takes_over_when_the_scheduling_one_is_killed(
    trained_models: TinyModels, tmp_path: Path, postgres_databases: Callable[[], str]
) -> None:
    """Two `opd serve` replicas on one PostgreSQL database and one data dir (as two pods on one
    ReadWriteMany volume): one schedules, the other waits; the first is SIGKILLed mid-job and the second
    takes the lease, resumes the job from its checkpoint and finishes it, with the job started once."""
    env = {"OPD_MAX_CONCURRENT_JOBS": "1", "DATABASE_URL": postgres_databases()}
    roots = [TINY_MODELS_DIR, tmp_path]
    first = Server(tmp_path / "data", env=env, model_dirs=roots).start(ready_timeout=300, wait_ready=True)
    second = Server(tmp_path / "data", env=env, model_dirs=roots)
    try:
        second.start(ready_timeout=300, wait_ready=True)
        assert server_ready_checks(first)["scheduler"] == "leader"
        assert server_ready_checks(second) == {"database": "ok", "ray": "ok", "scheduler": "standby"}
        client = OPDClient(second.url, create_key(second.url, "replicas"))  # any replica takes requests
        job_id = client.run(**_run_args(trained_models, tmp_path, max_steps=4, save_steps=1))
        wait_for_job(client, job_id, lambda j: j.step >= 2, timeout_s=900)
        first.kill()

        final = wait_for_job(client, job_id, lambda j: j.status in ("succeeded", "failed", "cancelled"), 900)
        assert final.status == "succeeded", second.log()
        assert server_ready_checks(second)["scheduler"] == "leader"
        events = client.events(job_id, limit=1000).data
        messages = [e.message for e in events]
        assert sum(m.startswith("queued -> running") for m in messages) == 1
        assert any("server restarted; driver gone" in m for m in messages)
        assert any(m.startswith("resumed from checkpoint at step") for m in messages)
        metrics = client.metrics(job_id).data
        assert [r["step"] for r in metrics if r["kind"] == "train"] == [1, 2, 3, 4]
    finally:
        second.stop()
        first.stop()


def server_ready_checks(server: Server) -> dict[str, str]:
    import httpx

    return httpx.get(server.url + "/readyz").json()["checks"]
