"""`AgenticRL().run(...)` against the real server: the ported Bailian submission script, and refusals."""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

import pytest
from apiserver import Server, Tenant, jsonl, record

from opd_trainer.client.agentic_rl import AgenticRL, SubmissionResult, TrainingDataset

PORTED_WORKSPACE = Path(__file__).resolve().parents[1] / "integration" / "bailian_port" / "workspace"


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, server: Server, tenant: Tenant) -> Tenant:
    # AgenticRL() takes no arguments in Bailian's scripts: the server and key come from here.
    monkeypatch.setenv("OPD_BASE_URL", server.url)
    monkeypatch.setenv("OPD_API_KEY", tenant.key)
    return tenant


def load_script(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"ported_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ported_submission_script_uploads_and_submits(env: Tenant, tmp_path: Path) -> None:
    workspace = tmp_path / "workspace"
    shutil.copytree(PORTED_WORKSPACE, workspace, ignore=shutil.ignore_patterns("__pycache__"))
    (workspace / "data").mkdir()
    for name in ("train.jsonl", "validation.jsonl"):
        (workspace / "data" / name).write_bytes(jsonl([record("hello"), record("world")]))
    script = load_script(workspace / "submit.py")
    # The seed's own runtime (10 workers of 2 CPUs) is fine here: this server never starts the job.
    job_id = asyncio.run(script.submit(model=env.models["student"], teacher_model=env.models["teacher"]))
    job = env.client.get_job(job_id)
    assert job.status == "queued"
    spec = job.spec
    [train], [validation] = spec["training_datasets"], spec["validation_datasets"]
    assert train.startswith("file-") and validation.startswith("file-")
    assert env.client.get_file(train).samples == 2
    [rollout] = spec["functions"]
    assert rollout["type"] == "rollout" and rollout["name"] == "my-rollout"
    assert env.client.get_file(rollout["fcmodel"]["workspace"]).purpose == "workspace"
    assert rollout["runtime"]["capacity"] == 10 and rollout["timeout"] == 120
    assert spec["ignored_fields"] == {
        "resources.charge_type": "mtu_postpaid",
        "resources.mtu_spec_code": "MTU4",
        "resources.mtu_capacity": 24,
    }


def run(**overrides: object) -> SubmissionResult:
    arguments: dict[str, object] = {"job_name": "j", "model": "", "teacher_model": ""}
    arguments.update(overrides)
    return asyncio.run(AgenticRL().run(**arguments))  # type: ignore[arg-type]


def test_an_uploaded_file_id_is_used_as_is_and_refusals_are_results(env: Tenant) -> None:
    dataset = env.upload(jsonl([record("a"), record("b")]))["id"]
    models = {"model": env.models["student"], "teacher_model": env.models["teacher"]}
    accepted = run(training_datasets=[TrainingDataset(file_name=dataset)], **models)
    assert accepted.status_code == 200, accepted
    assert env.client.get_job(accepted.output.job_id).spec["training_datasets"] == [dataset]

    missing = run(training_datasets=[TrainingDataset(file_name="file-000000000000000000000000")], **models)
    assert (missing.status_code, missing.code, missing.param) == (404, "not_found", "training_datasets.0")
    assert missing.output.job_id is None

    other = run(
        training_datasets=[{"file_name": dataset}], model=env.models["other"], teacher_model=models["model"]
    )
    assert other.status_code == 400 and other.output.job_id is None  # pre-flight: different tokenizers


def test_a_wrong_key_is_a_401_result(env: Tenant, monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = env.upload(jsonl([record("a")]))["id"]
    monkeypatch.setenv("OPD_API_KEY", "opd-not-a-key")
    result = run(
        training_datasets=[dataset], model=env.models["student"], teacher_model=env.models["teacher"]
    )
    assert result.status_code == 401 and result.output.job_id is None and result.message
