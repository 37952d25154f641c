"""Files over real HTTP: dataset validation, workspace extraction under the data dir, ownership, deletion."""

from __future__ import annotations

from pathlib import Path

from apiserver import Server, Tenant, jsonl, record


def test_dataset_upload_counts_validated_records(tenant: Tenant) -> None:
    uploaded = tenant.upload(jsonl([record("a"), record("b", rollout_extra={"solution": "x"})]))
    assert uploaded["purpose"] == "dataset" and uploaded["samples"] == 2 and uploaded["object"] == "file"
    assert tenant.http.get(f"/v1/files/{uploaded['id']}").json() == uploaded
    listed = tenant.http.get("/v1/files", params={"purpose": "dataset"}).json()["data"]
    assert [f["id"] for f in listed] == [uploaded["id"]]
    assert tenant.http.get("/v1/files", params={"purpose": "workspace"}).json()["data"] == []


def test_workspace_is_extracted_under_the_data_dir(
    server: Server, tenant: Tenant, workspace_zip: bytes
) -> None:
    uploaded = tenant.upload(workspace_zip, "workspace", "ws.zip")
    extracted = server.data_dir / "workspaces" / uploaded["id"]
    assert (extracted / "functions" / "reward.py").read_bytes().startswith(b"from opd_trainer.sdk")
    assert extracted.resolve().is_relative_to(server.data_dir.resolve())


def test_python_client_zips_a_workspace_folder(server: Server, tenant: Tenant, workspace_dir: Path) -> None:
    (workspace_dir / "functions" / "__pycache__").mkdir()
    (workspace_dir / "functions" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    uploaded = tenant.client.upload_file(workspace_dir, "workspace")
    extracted = server.data_dir / "workspaces" / uploaded.id
    assert sorted(p.relative_to(extracted).as_posix() for p in extracted.rglob("*.py")) == [
        "functions/__init__.py",
        "functions/reward.py",
    ]
    assert not (extracted / "functions" / "__pycache__").exists()


def test_files_are_private_to_their_tenant(tenant: Tenant, other_tenant: Tenant) -> None:
    mine = tenant.upload(jsonl([record()]))
    assert other_tenant.http.get(f"/v1/files/{mine['id']}").status_code == 404
    assert other_tenant.http.delete(f"/v1/files/{mine['id']}").status_code == 404
    assert other_tenant.http.get("/v1/files").json()["data"] == []


def test_delete_removes_the_file_and_refuses_while_a_job_uses_it(server: Server, tenant: Tenant) -> None:
    job = tenant.job()
    dataset_id = job["spec"]["training_datasets"][0]
    busy = tenant.http.delete(f"/v1/files/{dataset_id}")
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "file_in_use"
    assert tenant.http.post(f"/v1/opd/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
    assert tenant.http.delete(f"/v1/files/{dataset_id}").json() == {
        "id": dataset_id,
        "object": "file",
        "deleted": True,
    }
    assert tenant.http.get(f"/v1/files/{dataset_id}").status_code == 404
    assert not (server.data_dir / "files" / dataset_id).exists()
