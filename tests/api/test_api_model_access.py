"""Which models a job may name: the operator's approved folders and the tenant's own jobs, nothing else.

The answer for a refused path is the same whether it exists or not, so it tells nobody what is on the
server or which jobs other tenants run.
"""

from __future__ import annotations

from pathlib import Path

from apiserver import Server, Tenant, jsonl, record


def _submit(tenant: Tenant, **overrides: str) -> dict:
    dataset = tenant.upload(jsonl([record()]))
    response = tenant.http.post("/v1/opd/jobs", json=tenant.spec(dataset["id"], **overrides))
    return {"status": response.status_code, **response.json().get("error", {})}


def test_refusal_does_not_tell_whether_a_server_path_exists(tenant: Tenant) -> None:
    existing, missing = _submit(tenant, model="/etc"), _submit(tenant, model="/no/such/folder")
    assert existing["status"] == missing["status"] == 400
    assert existing["code"] == missing["code"] == "model_not_allowed" and existing["param"] == "model"
    assert existing["message"].replace("/etc", "X") == missing["message"].replace("/no/such/folder", "X")


def test_a_tenant_may_name_its_own_jobs_checkpoints_but_not_another_tenants(
    server: Server, tenant: Tenant, other_tenant: Tenant
) -> None:
    job = other_tenant.job()
    checkpoint = server.data_dir.resolve() / "runs" / job["id"] / "checkpoints" / "step-1" / "student"
    refused = _submit(tenant, model=str(checkpoint))
    assert (refused["status"], refused["code"], refused["param"]) == (400, "model_not_allowed", "model")
    # The owner passes the access check; this queued job has no checkpoint yet, so the folder is missing.
    owner = _submit(other_tenant, model=str(checkpoint))
    assert (owner["status"], owner["param"]) == (400, "model") and "not found" in owner["message"]
    assert str(server.data_dir.resolve()) not in owner["message"]  # named by the job's id instead


def test_a_link_inside_an_approved_folder_cannot_point_out_of_it(tenant: Tenant, models_root: Path) -> None:
    link = models_root / f"escape-{tenant.name}"
    link.symlink_to("/etc", target_is_directory=True)
    refused = _submit(tenant, model=str(link))
    assert (refused["status"], refused["code"]) == (400, "model_not_allowed")


def test_a_hugging_face_id_resolves_through_the_servers_hub_cache(tenant: Tenant, hub_cache: Path) -> None:
    """`org/name` is looked up in the server's hub cache with huggingface_hub (the cache entry here is
    made by hand, as `hf download` would leave it); the job keeps the id it was given."""
    import shutil

    revision = "89abcdef0123456789abcdef0123456789abcdef"
    repo = f"tiny-org/{tenant.name}-student"
    entry = hub_cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(tenant.models["student"], entry / "snapshots" / revision)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(revision)

    dataset = tenant.upload(jsonl([record()]))
    response = tenant.http.post("/v1/opd/jobs", json=tenant.spec(dataset["id"], model=repo))
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["model"] == repo

    missing = _submit(tenant, teacher_model="tiny-org/not-in-the-cache")
    assert (missing["status"], missing["param"]) == (400, "teacher_model")
    assert "not in the server's Hugging Face cache" in missing["message"]


def test_an_uploaded_model_can_be_a_jobs_model_for_its_tenant_only(
    tenant: Tenant, other_tenant: Tenant, tmp_path: Path
) -> None:
    """A Hugging Face folder uploaded with purpose `model` (the client zips it, stored, on disk) is
    checked, extracted, and named by its file id; it stays while a job uses it."""
    import io
    import zipfile

    model = tenant.client.upload_file(tenant.models["student"], purpose="model")
    assert model.purpose == "model"
    dataset = tenant.upload(jsonl([record()]))
    response = tenant.http.post("/v1/opd/jobs", json=tenant.spec(dataset["id"], model=model.id))
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["model"] == model.id
    in_use = tenant.http.delete(f"/v1/files/{model.id}")
    assert in_use.status_code == 409 and in_use.json()["error"]["code"] == "file_in_use"

    stolen = _submit(other_tenant, model=model.id)
    assert (stolen["status"], stolen["param"]) == (404, "model")
    wrong_kind = _submit(tenant, teacher_model=dataset["id"])
    assert (wrong_kind["status"], wrong_kind["code"]) == (400, "wrong_file_purpose")

    no_config = io.BytesIO()
    with zipfile.ZipFile(no_config, "w") as archive:
        archive.writestr("weights/model.safetensors", b"x" * 16)
    refused = tenant.http.post(
        "/v1/files", files={"file": ("m.zip", no_config.getvalue())}, data={"purpose": "model"}
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "file"
    assert "not a Hugging Face model folder" in refused.json()["error"]["message"]


def test_a_hub_revision_that_is_a_path_is_refused_alike_whatever_it_reaches(
    server: Server, tenant: Tenant, other_tenant: Tenant
) -> None:
    """Issue 29: `org/x@<data dir>/uploaded-models/<id>/ptr` reached another tenant's model folder
    through a pointer file, and `@/etc` and `@/nonexistent` answered differently. Every revision with
    a path in it now gets one answer, naming the field and no server path."""
    model = other_tenant.client.upload_file(other_tenant.models["student"], purpose="model")
    data = server.data_dir.resolve()
    revisions = [f"{data}/uploaded-models/{model.id}/ptr", "/etc", "/nonexistent", f"{data}/runs", "../../x"]
    answers = [_submit(tenant, model=f"tiny-org/x@{revision}") for revision in revisions]
    for answer in answers:
        assert (answer["status"], answer["param"]) == (400, "model"), answer
        assert str(data) not in answer["message"] and "/etc" not in answer["message"]
    assert len({answer["message"] for answer in answers}) == 1
    assert "not a commit hash, branch or tag name" in answers[0]["message"]


def test_a_checkpoint_is_named_by_its_job_id_and_only_its_tenant_may_use_it(
    tenant: Tenant, other_tenant: Tenant
) -> None:
    job = other_tenant.job()
    name = f"{job['id']}/checkpoints/step-000001/student"
    refused = _submit(tenant, model=name)
    assert (refused["status"], refused["code"], refused["param"]) == (400, "model_not_allowed", "model")
    # The owner passes the access check; this queued job has no checkpoint yet. The answer names the
    # checkpoint as the owner does, not by its folder on the server.
    owner = _submit(other_tenant, teacher_model=name)
    assert (owner["status"], owner["param"]) == (400, "teacher_model")
    assert owner["message"] == f"model folder {name} not found on the server"


def test_each_of_several_teachers_is_checked_and_named(tenant: Tenant) -> None:
    """`teacher_model` as a list: every teacher passes the same access, folder and tokenizer checks as
    one, and a refusal names the teacher's entry (`teacher_model.I.model`)."""
    dataset = tenant.upload(jsonl([record()]))
    teachers = [
        {"name": "general", "model": tenant.models["teacher"]},
        {"name": "echo", "model": "self", "data_tags": ["echo"]},
    ]
    response = tenant.http.post("/v1/opd/jobs", json=tenant.spec(dataset["id"], teacher_model=teachers))
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["teacher_model"] == [
        {"name": "general", "model": tenant.models["teacher"], "data_tags": []},
        {"name": "echo", "model": tenant.models["student"], "data_tags": ["echo"]},
    ]

    outside = _submit(tenant, teacher_model=[teachers[0], {"name": "x", "model": "/etc", "data_tags": ["x"]}])
    assert (outside["status"], outside["code"], outside["param"]) == (
        400,
        "model_not_allowed",
        "teacher_model.1.model",
    )
    mismatched = _submit(
        tenant,
        teacher_model=[teachers[0], {"name": "x", "model": tenant.models["other"], "data_tags": ["x"]}],
    )
    assert (mismatched["status"], mismatched["param"]) == (400, "teacher_model.1.model")
    assert "tokenizer differs" in mismatched["message"]
    duplicate = _submit(tenant, teacher_model=[teachers[0], {**teachers[0], "data_tags": ["x"]}])
    assert (duplicate["status"], duplicate["param"]) == (422, "teacher_model")
    misnamed = _submit(tenant, teacher_model=[{**teachers[0], "name": "no spaces"}])
    assert (misnamed["status"], misnamed["param"]) == (422, "teacher_model.0.name")
