"""Bailian-shaped jobs over real HTTP: dataset objects and Bailian-only fields kept, unknown ones refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from apiserver import Server, Tenant, jsonl, record

from opd_trainer.cli.main import main
from opd_trainer.jobspec.job_spec import JobSpec

BAILIAN_ONLY = {
    "resources.charge_type": "mtu_postpaid",
    "resources.mtu_spec_code": "MTU4",
    "resources.mtu_capacity": 24,
    "hyper_parameters.opd_teacher_replicas": 2,
}


def bailian_spec(tenant: Tenant, training: Any, validation: Any) -> dict[str, Any]:
    return {
        "job_name": "bailian",
        "model": tenant.models["student"],
        "teacher_model": tenant.models["teacher"],
        "training_datasets": [{"data_source_type": "FILE_ID", "file_name": training}],
        "validation_datasets": [{"data_source_type": "FILE_ID", "file_name": validation}],
        "hyper_parameters": {"max_steps": 2, "batch_size": 2, "opd_teacher_replicas": 2},
        "resources": {"charge_type": "mtu_postpaid", "mtu_spec_code": "MTU4", "mtu_capacity": 24},
    }


def test_bailian_job_is_accepted_and_its_ignored_fields_recorded(tenant: Tenant) -> None:
    train, validation = (tenant.upload(jsonl([record("a"), record("b")]))["id"] for _ in range(2))
    response = tenant.http.post("/v1/opd/jobs", json=bailian_spec(tenant, train, validation))
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["spec"]["training_datasets"] == [train] and job["spec"]["validation_datasets"] == [validation]
    assert job["spec"]["ignored_fields"] == BAILIAN_ONLY
    assert "charge_type" not in job["spec"]["resources"]
    stored = tenant.http.get(f"/v1/opd/jobs/{job['id']}").json()["spec"]
    assert stored == job["spec"]
    # What the scheduler hands the driver is this stored spec, parsed again.
    assert JobSpec.model_validate(stored).ignored_fields == BAILIAN_ONLY


@pytest.mark.parametrize(
    ("edit", "param", "named"),
    [
        (lambda s: s["resources"].update(mtu_spec="MTU4"), "resources.mtu_spec", "Extra inputs"),
        (
            lambda s: s["hyper_parameters"].update(opd_student_replicas=1),
            "hyper_parameters.opd_student_replicas",
            "Extra inputs",
        ),
        (lambda s: s.update(charge_type="mtu_postpaid"), "charge_type", "Extra inputs"),
        (
            lambda s: s["training_datasets"][0].update(data_source_type="OSS_URL"),
            "training_datasets.0",
            "data_source_type",
        ),
    ],
)
def test_unknown_fields_are_still_a_4xx_naming_them(
    tenant: Tenant, edit: Any, param: str, named: str
) -> None:
    dataset = tenant.upload(jsonl([record("a")]))["id"]
    spec = bailian_spec(tenant, dataset, dataset)
    edit(spec)
    response = tenant.http.post("/v1/opd/jobs", json=spec)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param and named in error["message"]


def test_opd_submit_uploads_the_local_files_a_bailian_job_file_names(
    tenant: Tenant,
    server: Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_bytes(jsonl([record("a"), record("b")]))
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(bailian_spec(tenant, "data/train.jsonl", "data/train.jsonl")))
    monkeypatch.setenv("OPD_BASE_URL", server.url)
    monkeypatch.setenv("OPD_API_KEY", tenant.key)
    assert main(["submit", str(job_file)]) == 0
    job = tenant.client.get_job(capsys.readouterr().out.split()[1])
    [dataset] = job.spec["training_datasets"]
    assert dataset.startswith("file-") and job.spec["validation_datasets"] == [dataset]
    assert tenant.client.get_file(dataset).samples == 2
    assert job.spec["ignored_fields"] == BAILIAN_ONLY
