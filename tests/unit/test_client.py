"""Both clients over a fake server (`httpx.MockTransport`): answers parse into the API's own models,
iterators page to the end, error answers become `OPDAPIError`, the event stream reconnects from its
cursor and ends with `StreamEnd`, submissions upload each local file once, checkpoints unpack."""

from __future__ import annotations

import io
import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest
from client_harness import KINDS, client, job_json, record_sleeps
from pydantic import BaseModel

from opd_trainer.client import OPDAPIError, StreamEnd
from opd_trainer.client.operations import api_error
from opd_trainer.errors import ConfigError
from opd_trainer.wire.schemas import (
    CheckpointPublic,
    Deleted,
    EventList,
    EventPublic,
    FilePublic,
    JobList,
    JobPublic,
    KeyPublic,
    MetricsPublic,
    ValidationTrajectoryList,
)

FILE = FilePublic(id="file-1", filename="d.jsonl", purpose="dataset", bytes=10, created_at=1, samples=2)
KEY = KeyPublic(id="key-1", tenant="t", prefix="opd-ab", created_at=1)
CHECKPOINT = CheckpointPublic(id="step-000002", step=2, created_at=1, path="/c", student="/c/student")


def event(event_id: int, kind: str = "status") -> dict[str, Any]:
    return EventPublic(id=event_id, time=float(event_id), type=kind, message=f"event {event_id}").model_dump(
        mode="json"
    )


def dumped(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")


def routes(table: dict[tuple[str, str], Any]) -> Any:
    """A server answering `(method, path)` with JSON (text for a str), 404 for anything else."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = table.get((request.method, request.url.path))
        if body is None:
            return httpx.Response(404, json={"error": {"code": "not_found", "message": "no such thing"}})
        if isinstance(body, str):
            return httpx.Response(200, text=body)
        return httpx.Response(200, json=body)

    return handle


@pytest.mark.parametrize("kind", KINDS)
def test_answers_are_the_apis_models(kind: str) -> None:
    job = "/v1/opd/jobs/opdjob-1"
    trajectory = {"rollout_id": "r1", "messages": [], "reward": 1.0}
    served: dict[tuple[str, str], Any] = {
        ("GET", job): job_json(),
        ("POST", f"{job}/cancel"): job_json(status="cancelled"),
        ("DELETE", job): {"id": "opdjob-1", "object": "opd.job", "deleted": True},
        ("GET", "/v1/files"): {"object": "list", "data": [dumped(FILE)]},
        ("GET", "/v1/files/file-1"): dumped(FILE),
        ("POST", "/v1/keys"): dumped(KEY.model_copy(update={"key": "opd-secret"})),
        ("GET", "/v1/keys"): {"object": "list", "data": [dumped(KEY)]},
        ("GET", f"{job}/checkpoints"): {"object": "list", "data": [dumped(CHECKPOINT)]},
        ("GET", f"{job}/metrics"): {"object": "opd.job.metrics", "data": [{"kind": "train"}], "summary": {}},
        ("GET", f"{job}/trajectories"): {"object": "list", "data": [trajectory]},
        ("GET", f"{job}/validation_trajectories"): {
            "object": "list",
            "data": [{"step": 0, "label": "teacher", "model": "teacher", "sample_id": "q0"}],
            "passes": [{"step": 0, "label": "teacher", "model": "teacher"}],
            "steps": [0],
            "labels": ["teacher"],
        },
        ("GET", f"{job}/logs"): "2026-01-01T00:00:00Z [status] queued\n",
    }
    with client(kind, routes(served)) as opd:
        got = opd.get_job("opdjob-1")
        assert isinstance(got, JobPublic) and got.status == "queued" and got.error is None
        assert got.model_dump(mode="json") == served["GET", job]  # `-o json` prints what the server sent
        assert opd.cancel_job("opdjob-1").status == "cancelled"
        assert opd.delete_job("opdjob-1") == Deleted(id="opdjob-1", object="opd.job")
        assert opd.list_files() == [FILE] and opd.get_file("file-1") == FILE
        assert opd.create_key("t", "admin").key == "opd-secret"
        assert opd.list_keys() == [KEY]
        assert opd.checkpoints("opdjob-1") == [CHECKPOINT]
        metrics = opd.metrics("opdjob-1")
        assert isinstance(metrics, MetricsPublic) and metrics.data == [{"kind": "train"}]
        assert opd.trajectories("opdjob-1") == [trajectory]  # free-form in the API's schema: dicts
        validation = opd.validation_trajectories("opdjob-1", label="teacher")
        assert isinstance(validation, ValidationTrajectoryList) and validation.passes[0].model == "teacher"
        assert opd.logs("opdjob-1").endswith("[status] queued\n")


@pytest.mark.parametrize("kind", KINDS)
def test_iterators_page_to_the_end(kind: str) -> None:
    jobs = [job_json(f"opdjob-{i}") for i in range(5)]
    events = [event(i) for i in range(1, 8)]
    cursors: list[str | None] = []

    def handle(request: httpx.Request) -> httpx.Response:
        params = request.url.params
        limit = int(params["limit"])
        if request.url.path == "/v1/opd/jobs":
            cursors.append(params.get("after"))
            start = 0 if "after" not in params else [j["id"] for j in jobs].index(params["after"]) + 1
            page = jobs[start : start + limit]
            return httpx.Response(200, json={"data": page, "has_more": start + limit < len(jobs)})
        after = int(params["after"])
        page = [e for e in events if e["id"] > after][:limit]
        return httpx.Response(200, json={"data": page, "has_more": bool(page) and page[-1]["id"] < 7})

    with client(kind, handle) as opd:
        assert [j.id for j in opd.iter_jobs(page_size=2)] == [j["id"] for j in jobs]
        assert cursors == [None, "opdjob-1", "opdjob-3"]
        assert [e.id for e in opd.iter_events("opdjob-1", after=2, page_size=2)] == [3, 4, 5, 6, 7]
        assert all(isinstance(e, EventPublic) for e in opd.iter_events("opdjob-1"))
        page = opd.list_jobs(limit=2)
        assert isinstance(page, JobList) and page.has_more and len(page.data) == 2
        assert isinstance(opd.events("opdjob-1", after=6), EventList)

    # A page that says more follow but holds nothing ends the iteration (no request loop).
    def empty(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"data": [], "has_more": True})

    with client(kind, empty) as opd:
        assert list(opd.iter_jobs()) == [] and list(opd.iter_events("opdjob-1")) == []


@pytest.mark.parametrize("kind", KINDS)
def test_error_answers_are_opdapierrors(kind: str) -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/v1/files"):
            return httpx.Response(500, text="<html>proxy error</html>")
        error = {"code": "not_found", "message": "no job with id 'x'", "param": "job_id"}
        return httpx.Response(404, json={"error": error})

    with client(kind, handle) as opd:
        with pytest.raises(OPDAPIError) as missing:
            opd.get_job("x")
        assert (missing.value.status, missing.value.code, missing.value.field) == (404, "not_found", "job_id")
        assert str(missing.value) == "job_id: no job with id 'x'"
        with pytest.raises(OPDAPIError) as proxy:
            opd.list_files()
        assert (proxy.value.status, proxy.value.code) == (500, "http_error")
        assert proxy.value.message == "HTTP 500: <html>proxy error</html>"
    copy = pickle.loads(pickle.dumps(missing.value))
    assert (copy.status, copy.code, copy.field, copy.message) == (
        404,
        "not_found",
        "job_id",
        missing.value.message,
    )
    assert api_error(httpx.Response(502)).message == "HTTP 502: Bad Gateway"


def sse(*events: tuple[str, dict[str, Any]]) -> str:
    lines = [": ping\n\n"]
    for kind, data in events:
        event_id = f"id: {data['id']}\n" if kind not in ("end", "shutdown") else ""
        lines.append(f"{event_id}event: {kind}\ndata: {json.dumps(data)}\n\n")
    return "".join(lines)


@pytest.mark.parametrize("kind", KINDS)
def test_the_event_stream_reconnects_from_its_cursor_and_ends_with_the_job(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept = record_sleeps(monkeypatch)
    finished = job_json(status="cancelled")
    bodies = [
        sse(("status", event(1)), ("status", event(2)), ("shutdown", {"id": "opdjob-1", "after": 2})),
        sse(("step", event(3, "step")), ("end", finished)),
    ]
    asked: list[tuple[str | None, str | None]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        assert request.headers["Accept"] == "text/event-stream"
        asked.append((request.headers.get("Last-Event-ID"), request.url.params.get("after")))
        return httpx.Response(200, text=bodies.pop(0), headers={"Content-Type": "text/event-stream"})

    with client(kind, handle) as opd:
        items = list(opd.stream_events("opdjob-1"))
    assert [type(i).__name__ for i in items] == ["EventPublic"] * 3 + ["StreamEnd"]
    assert [i.id for i in items[:3]] == [1, 2, 3] and items[2].type == "step"
    assert items[-1] == StreamEnd(job_id="opdjob-1", job=JobPublic.model_validate(finished))
    assert asked == [("0", "0"), ("2", "2")]  # the restart is followed from the last event received
    assert slept == [2.0]

    # A job deleted while followed: the end carries its id only.
    def deleted(request: httpx.Request) -> httpx.Response:
        body = sse(("end", {"id": "opdjob-1", "deleted": True}))
        return httpx.Response(200, text=body, headers={"Content-Type": "text/event-stream"})

    with client(kind, deleted) as opd:
        assert list(opd.stream_events("opdjob-1", after=5)) == [StreamEnd(job_id="opdjob-1", job=None)]

    def missing(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            404, json={"error": {"code": "not_found", "message": "no job", "param": "job_id"}}
        )

    with client(kind, missing) as opd, pytest.raises(OPDAPIError, match="no job"):
        list(opd.stream_events("opdjob-1"))  # an answer, not a lost connection: no reconnect
    assert slept == [2.0]


@pytest.mark.parametrize("kind", KINDS)
def test_submit_and_run_upload_each_local_file_once(kind: str, tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text('{"messages": []}\n')
    workspace = tmp_path / "scorer"
    (workspace / "functions").mkdir(parents=True)
    (workspace / "functions" / "reward.py").write_text("class MyReward: ...\n")
    uploaded: list[tuple[str, str]] = []
    submitted: list[dict[str, Any]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/files":
            body = request.read()
            purpose = "workspace" if b'name="purpose"\r\n\r\nworkspace' in body else "dataset"
            filename = body.split(b'filename="', 1)[1].split(b'"', 1)[0].decode()
            uploaded.append((filename, purpose))
            file = FILE.model_copy(update={"id": f"file-{len(uploaded)}", "purpose": purpose})
            return httpx.Response(201, json=dumped(file))
        submitted.append(json.loads(request.read()))
        return httpx.Response(201, json=job_json())

    spec = {
        "job_name": "j",
        "model": "m",
        "teacher_model": "t",
        "training_datasets": ["train.jsonl"],
        "validation_datasets": ["train.jsonl", "file-kept"],
        "functions": [
            {
                "name": "score",
                "type": "reward",
                "fcmodel": {"zipdir": "scorer", "classpath": "functions.reward.MyReward"},
            }
        ],
    }
    with client(kind, handle) as opd:
        assert isinstance(opd.submit(spec, base_dir=tmp_path), JobPublic)
        assert sorted(uploaded) == [("scorer.zip", "workspace"), ("train.jsonl", "dataset")]
        sent = submitted[-1]
        dataset = sent["training_datasets"][0]
        assert sent["validation_datasets"] == [dataset, "file-kept"]  # uploaded once, an id kept
        assert sent["functions"][0]["fcmodel"]["workspace"] in {"file-1", "file-2"} - {dataset}

        job_id = opd.run(
            job_name="j", model="m", teacher_model="t", training_datasets=[str(tmp_path / "train.jsonl")]
        )
        assert job_id == "opdjob-1" and submitted[-1]["validation_datasets"] == []
        with pytest.raises(ConfigError, match="neither a local file nor a file id") as bad:
            opd.run(job_name="j", model="m", teacher_model="t", training_datasets=["missing.jsonl"])
        assert bad.value.field == "training_datasets.0"


def checkpoint_zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("opdjob-1-step-000002/config.json", "{}")
        archive.writestr("opdjob-1-step-000002/model.safetensors", b"\0" * 1024)
    return buffer.getvalue()


@pytest.mark.parametrize("kind", KINDS)
def test_download_checkpoint_unpacks_the_model_folder(kind: str, tmp_path: Path) -> None:
    content = "/v1/opd/jobs/opdjob-1/checkpoints/step-000002/content"

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == content:
            return httpx.Response(200, content=checkpoint_zip(), headers={"Content-Type": "application/zip"})
        if request.url.path == "/v1/opd/jobs/opdjob-1":
            return httpx.Response(200, json=job_json(status="succeeded", fine_tuned_model="step-000002"))
        if request.url.path == "/v1/opd/jobs/opdjob-2":
            return httpx.Response(200, json=job_json("opdjob-2", status="running"))
        return httpx.Response(404, json={"error": {"code": "not_found", "message": "no checkpoint"}})

    with client(kind, handle) as opd:
        folder = opd.download_checkpoint("opdjob-1", target=tmp_path / "student")  # fine_tuned_model
        assert folder == tmp_path / "student"
        assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
        assert [p.name for p in tmp_path.iterdir()] == ["student"]  # no scratch left behind
        with pytest.raises(ConfigError, match="already exists"):
            opd.download_checkpoint("opdjob-1", "step-000002", target=folder)
        with pytest.raises(ConfigError, match="no fine_tuned_model") as none_yet:
            opd.download_checkpoint("opdjob-2")
        assert none_yet.value.field == "checkpoint_id"
        with pytest.raises(OPDAPIError, match="no checkpoint"):
            opd.download_checkpoint("opdjob-1", "step-000009", target=tmp_path / "other")


@pytest.mark.parametrize("kind", KINDS)
def test_wait_polls_until_the_job_finishes(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    slept = record_sleeps(monkeypatch)
    statuses = ["queued", "running", "succeeded"]

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=job_json(status=statuses.pop(0) if statuses else "running"))

    with client(kind, handle) as opd:
        assert opd.wait("opdjob-1", poll_s=5).status == "succeeded"
        assert slept == [5, 5]
        with pytest.raises(TimeoutError, match="still running"):
            opd.wait("opdjob-1", timeout_s=0)
