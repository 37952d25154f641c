"""The web console's assets as the job server serves them (api/routes/console.py): the page, its
script and Plotly's bundle from the installed wheel, nothing else, and none of it in the OpenAPI."""

import re
from pathlib import Path

from fastapi.testclient import TestClient

from api.main import create_app
from api.settings import Settings


def _client(tmp_path: Path) -> TestClient:
    return TestClient(create_app(Settings(data_dir=tmp_path, admin_key="opd-admin-test-key-0123456789")))


def test_console_page_and_assets_are_served(tmp_path: Path) -> None:
    client = _client(tmp_path)
    page = client.get("/console/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/console/static/app.js" in page.text and "/console/static/plotly.min.js" in page.text
    assert client.get("/console", follow_redirects=False).headers["location"] == "/console/"
    script = client.get("/console/static/app.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "sessionStorage" in script.text
    plotly = client.get("/console/static/plotly.min.js")
    assert plotly.status_code == 200 and len(plotly.content) > 1_000_000
    assert b"plotly.js" in plotly.content[:2000]
    assert client.get("/console/static/console.css").status_code == 200


def test_only_known_assets_are_served(tmp_path: Path) -> None:
    client = _client(tmp_path)
    for name in ("__init__.py", "..%2Fmain.py", "nothing.js"):
        assert client.get(f"/console/static/{name}").status_code == 404


def test_console_is_not_in_openapi_and_calls_only_tenant_routes(tmp_path: Path) -> None:
    schema = _client(tmp_path).get("/openapi.json").json()
    assert not [p for p in schema["paths"] if p.startswith("/console")]
    script = (Path(__file__).parents[2] / "api" / "console" / "app.js").read_text()
    called = re.findall(r"(?:json|api)\(`([^`]*)`", script)
    assert called and all(path.startswith("/v1/opd/jobs") for path in called), called


def test_the_trajectory_view_asks_only_for_parameters_the_route_declares(tmp_path: Path) -> None:
    schema = _client(tmp_path).get("/openapi.json").json()
    declared = {p["name"] for p in schema["paths"]["/v1/opd/jobs/{job_id}/trajectories"]["get"]["parameters"]}
    script = (Path(__file__).parents[2] / "api" / "console" / "app.js").read_text()
    asked = {
        name
        for query in re.findall(r"/trajectories\?([^`]*)`", script)
        for name in re.findall(r"(?:^|&)(\w+)=", query)
    }
    assert asked == {"limit", "step", "sort", "order", "offset"} and asked <= declared, (asked, declared)
