"""The OpenAPI spec is valid, and a bounded property-based run over it (schemathesis) finds no 5xx."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import httpx
import schemathesis
from apiserver import Server, Tenant, jsonl, record


def test_openapi_spec_is_valid_and_documents_the_error_shape(server: Server) -> None:
    spec = httpx.get(server.url + "/openapi.json").json()
    schema = schemathesis.openapi.from_dict(spec)  # raises on an invalid document
    operations = [op for op in schema.get_all_operations()]
    assert len(operations) >= 17
    assert spec["components"]["schemas"]["ErrorResponse"]["properties"].keys() == {"error"}
    paths = spec["paths"]
    # Each route lists the errors it can answer, all in the one shape; nothing it cannot.
    assert set(paths["/v1/opd/jobs"]["post"]["responses"]) == {
        "201",
        "400",
        "401",
        "403",
        "404",
        "413",
        "422",
        "429",
        "500",
        "503",
    }
    # 429: every tenant route answers a key past its request rate.
    assert set(paths["/v1/opd/jobs/{job_id}"]["get"]["responses"]) == {
        "200",
        "401",
        "403",
        "404",
        "429",
        "500",
        "503",
    }
    assert set(paths["/healthz"]["get"]["responses"]) == {"200", "500"}
    assert paths["/readyz"]["get"]["responses"]["503"]["content"]["application/json"]["schema"][
        "$ref"
    ].endswith("/Health")
    for route in paths.values():
        for operation in route.values():
            for status, response in operation["responses"].items():
                if status >= "400" and status != "503":
                    ref = response["content"]["application/json"]["schema"]["$ref"]
                    assert ref.endswith("/ErrorResponse"), (operation["operationId"], status)
    # Stable operation ids (the route functions' names), the event stream's media type, examples.
    assert paths["/v1/opd/jobs"]["post"]["operationId"] == "create_job"
    assert "text/event-stream" in paths["/v1/opd/jobs/{job_id}/events"]["get"]["responses"]["200"]["content"]
    assert spec["components"]["schemas"]["JobCreate"]["examples"][0]["job_name"]
    # Every field of every schema says what it is.
    undocumented = [
        f"{name}.{field}"
        for name, component in spec["components"]["schemas"].items()
        for field, value in (component.get("properties") or {}).items()
        if "description" not in value
    ]
    assert undocumented == []


def test_a_client_generated_from_the_spec_submits_and_reads_a_job(
    server: Server, tenant: Tenant, tmp_path: Path
) -> None:
    """openapi-python-client, a standard generator, builds a client from /openapi.json as served;
    that client uploads a dataset, submits a job and reads it back."""
    import importlib

    (tmp_path / "openapi.json").write_text(httpx.get(server.url + "/openapi.json").text)
    (tmp_path / "config.yaml").write_text("post_hooks: []\npackage_name_override: opd_generated\n")
    generator = Path(sys.executable).parent / "openapi-python-client"
    done = subprocess.run(
        [str(generator), "generate", "--path", "openapi.json", "--config", "config.yaml", "--meta", "none"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    sys.path.insert(0, str(tmp_path))
    try:
        generated = importlib.import_module("opd_generated")
        client = generated.AuthenticatedClient(base_url=server.url, token=tenant.key)
        upload = importlib.import_module("opd_generated.api.files.upload_file")
        create = importlib.import_module("opd_generated.api.jobs.create_job")
        get = importlib.import_module("opd_generated.api.jobs.get_job")
        models = importlib.import_module("opd_generated.models")
        types = importlib.import_module("opd_generated.types")

        dataset = upload.sync(
            client=client,
            body=models.BodyUploadFile(
                file=types.File(payload=io.BytesIO(jsonl([record()])), file_name="d.jsonl"),
                purpose=models.BodyUploadFilePurpose.DATASET,
            ),
        )
        assert isinstance(dataset, models.FilePublic) and dataset.samples == 1
        job = create.sync(client=client, body=models.JobCreate.from_dict(tenant.spec(dataset.id)))
        assert isinstance(job, models.JobPublic), job
        assert get.sync(client=client, job_id=job.id).status == models.JobStatus.QUEUED
        missing = get.sync(client=client, job_id="opdjob-none")
        assert isinstance(missing, models.ErrorResponse) and missing.error.code == "not_found"
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "opd_generated" or m.startswith("opd_generated.")]:
            del sys.modules[name]


def test_property_based_run_finds_no_server_errors(server: Server, tenant: Tenant, tmp_path: Path) -> None:
    tenant.job()  # something to list, page through and act on
    report = tmp_path / "schemathesis.json"
    command = [
        str(Path(sys.executable).parent / "schemathesis"),
        "run",
        server.url + "/openapi.json",
        "--checks",
        "not_a_server_error",
        "--max-examples",
        "12",
        "--seed",
        "7",
        "--workers",
        "1",
        "--phases",
        "examples,coverage,fuzzing",
        "--generation-database",
        "none",
        "--request-timeout",
        "30",
        "--no-color",
        "-H",
        f"Authorization: Bearer {tenant.key}",
        "--report",
        "json",
        "--report-json-path",
        str(report),
    ]
    # From tmp_path: schemathesis keeps a cache folder in its working directory.
    result = subprocess.run(command, capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert httpx.get(server.url + "/healthz").status_code == 200
