"""The OpenAPI spec is valid, and a bounded property-based run over it (schemathesis) finds no 5xx."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import schemathesis
from apiserver import Server, Tenant


def test_openapi_spec_is_valid_and_documents_the_error_shape(server: Server) -> None:
    spec = httpx.get(server.url + "/openapi.json").json()
    schema = schemathesis.openapi.from_dict(spec)  # raises on an invalid document
    operations = [op for op in schema.get_all_operations()]
    assert len(operations) >= 17
    assert spec["components"]["schemas"]["ErrorResponse"]["properties"].keys() == {"error"}
    post_job = spec["paths"]["/v1/opd/jobs"]["post"]
    assert {"400", "401", "404", "409", "413", "422", "429"} <= post_job["responses"].keys()
    assert "JobCreate" in spec["components"]["schemas"]


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
