"""Quotas and limits over real HTTP on a real server (SQLite file, scheduler off) with small settings:
per-tenant file count and bytes, zip bombs, bounded dataset parsing, model folders that ask for
custom code, per-key rate limits, and bounded event streams."""

from __future__ import annotations

import io
import json
import threading
import time
import uuid
import zipfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path

import httpx
import pytest
from apiserver import Server, Tenant, create_key, jsonl, make_tenant, make_tokenizer, record, zip_bytes

from opd_trainer.client.api_client import OPDClient
from opd_trainer.client.operations import StreamEnd
from opd_trainer.wire.schemas import EventPublic

KIB = 1024
MIB = 1024 * KIB
LIMITS = {
    "OPD_MAX_CONCURRENT_JOBS": "0",
    "OPD_MAX_UPLOAD_BYTES": str(256 * KIB),
    "OPD_MAX_BODY_BYTES": str(64 * KIB),
    "OPD_TENANT_MAX_FILES": "3",
    "OPD_TENANT_MAX_FILE_BYTES": str(1 * MIB),
    "OPD_DATASET_MAX_LINE_BYTES": str(4 * KIB),
    "OPD_DATASET_MAX_RECORDS": "50",
    "OPD_MODEL_MAX_TOKENIZER_BYTES": str(64 * KIB),
    "OPD_RATE_LIMIT_PER_S": "4",
    "OPD_RATE_LIMIT_BURST": "20",
    "OPD_EVENT_STREAM_MAX_S": "2",
    "OPD_EVENT_STREAMS_PER_TENANT": "2",
}


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory, models_root: Path, hub_cache: Path) -> Iterator[Server]:
    data_dir = tmp_path_factory.mktemp("limits") / "data"
    env = {**LIMITS, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    server = Server(data_dir, env=env, model_dirs=[models_root]).start()
    yield server
    server.stop()


@pytest.fixture
def new_tenant(limited: Server, models: dict[str, str]) -> Iterator[Tenant]:
    """A fresh tenant (its own quota and its own key's bucket) on the limited server."""
    yield from make_tenant(limited, models)


def post_file(
    tenant: Tenant, content: bytes, purpose: str = "dataset", name: str = "d.jsonl"
) -> httpx.Response:
    return tenant.http.post("/v1/files", files={"file": (name, content)}, data={"purpose": purpose})


def stored_folders(server: Server) -> set[str]:
    return {
        str(path.relative_to(server.data_dir))
        for folder in ("files", "workspaces", "uploaded-models")
        if (server.data_dir / folder).is_dir()
        for path in (server.data_dir / folder).iterdir()
    }


def error_of(response: httpx.Response) -> dict[str, str | None]:
    body = response.json()
    assert set(body) == {"error"}, body
    return body["error"]


# -- quotas -------------------------------------------------------------------------------------------


def test_the_file_count_quota_refuses_the_next_upload_and_loses_nothing(
    limited: Server, new_tenant: Tenant
) -> None:
    kept = [new_tenant.upload(jsonl([record(str(i))])) for i in range(3)]
    before = stored_folders(limited)
    refused = post_file(new_tenant, jsonl([record("one too many")]))
    assert refused.status_code == 429, refused.text
    error = error_of(refused)
    assert error["code"] == "file_limit_reached" and "OPD_TENANT_MAX_FILES" in str(error["message"])
    assert refused.headers.get("retry-after") is None  # a limit, not "slow down": clients do not retry it
    assert stored_folders(limited) == before
    listed = new_tenant.http.get("/v1/files").json()["data"]
    assert sorted(f["id"] for f in listed) == sorted(f["id"] for f in kept)
    for uploaded in kept:
        assert new_tenant.http.get(f"/v1/files/{uploaded['id']}").json()["samples"] == 1
    # Deleting one makes room again.
    assert new_tenant.http.delete(f"/v1/files/{kept[0]['id']}").status_code == 200
    assert post_file(new_tenant, jsonl([record("fits now")])).status_code == 201


def _text_zip(uncompressed: int) -> bytes:
    """A workspace zip of `uncompressed` bytes of varied text: it compresses ~10x, no bomb."""
    lines = b"".join(
        f"value_{i} = {i * 7919 % 100_003}  # {uuid.UUID(int=i)}\n".encode() for i in range(99_999)
    )
    return zip_bytes({"functions/__init__.py": b"", "functions/table.py": lines[:uncompressed]})


def test_the_bytes_quota_counts_what_a_zip_extracts_to_and_refuses_before_extracting(
    limited: Server, new_tenant: Tenant, other_tenant_on_limited: Tenant
) -> None:
    first = new_tenant.upload(_text_zip(600 * KIB), "workspace", "a.zip")
    assert first["bytes"] < 256 * KIB  # the upload is small; what it extracts to is not
    before = stored_folders(limited)
    second = _text_zip(600 * KIB)
    refused = post_file(new_tenant, second, "workspace", "b.zip")
    assert refused.status_code == 413, refused.text
    error = error_of(refused)
    assert error["code"] == "storage_quota_exceeded" and error["param"] == "file"
    assert "OPD_TENANT_MAX_FILE_BYTES" in str(error["message"]) and str(1 * MIB) in str(error["message"])
    assert stored_folders(limited) == before  # nothing extracted, nothing left of the refused upload
    workspace = limited.data_dir / "workspaces" / first["id"] / "functions" / "table.py"
    assert workspace.stat().st_size == 600 * KIB  # what was stored is untouched
    # Quotas are per tenant: another tenant stores the same zip.
    assert post_file(other_tenant_on_limited, second, "workspace", "b.zip").status_code == 201


@pytest.fixture
def other_tenant_on_limited(limited: Server, models: dict[str, str]) -> Iterator[Tenant]:
    key = create_key(limited.url, f"o-{uuid.uuid4().hex[:8]}")
    http = httpx.Client(base_url=limited.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    yield Tenant("other", key, http, OPDClient(limited.url, key), models)
    http.close()


def test_a_zip_bomb_split_into_small_entries_is_refused(limited: Server, new_tenant: Tenant) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        for i in range(40):  # each under the 1 MiB per-entry check; 20 MiB of zeros together
            archive.writestr(f"functions/z{i}.py", b"\0" * (MIB // 2))
    before = stored_folders(limited)
    refused = post_file(new_tenant, buffer.getvalue(), "workspace", "bomb.zip")
    assert refused.status_code == 400, refused.text
    assert "zip bomb" in str(error_of(refused)["message"]) and error_of(refused)["param"] == "file"
    assert stored_folders(limited) == before


# -- datasets and tokenizers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (jsonl([record("x" * (5 * KIB))]), "line 1 is longer than 4096 bytes (OPD_DATASET_MAX_LINE_BYTES)"),
        (jsonl([record(str(i)) for i in range(51)]), "more than 50 records (OPD_DATASET_MAX_RECORDS)"),
        (b"[" * 3000 + b"\n", "nested too deeply"),
    ],
)
def test_dataset_parsing_is_bounded(
    limited: Server, new_tenant: Tenant, content: bytes, message: str
) -> None:
    before = stored_folders(limited)
    refused = post_file(new_tenant, content)
    assert refused.status_code == 400, refused.text
    assert message in str(error_of(refused)["message"]) and error_of(refused)["param"] == "file"
    assert stored_folders(limited) == before
    assert new_tenant.upload(jsonl([record(str(i)) for i in range(50)]))["samples"] == 50


def _model_zip(folder: Path) -> bytes:
    return zip_bytes({path.name: path.read_bytes() for path in folder.iterdir()})


def test_a_model_that_names_custom_code_is_refused_before_its_tokenizer_is_loaded(
    limited: Server, new_tenant: Tenant, tmp_path: Path
) -> None:
    marker = tmp_path / "custom-code-ran"
    folder = make_tokenizer(tmp_path / "evil")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}
    config["tokenizer_class"] = "EvilTokenizer"  # only the folder's own code defines it
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tokenization_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n"
    )
    model = new_tenant.upload(_model_zip(folder), "model", "evil.zip")
    dataset = new_tenant.upload(jsonl([record("hello world")]))
    refused = new_tenant.http.post("/v1/opd/jobs", json=new_tenant.spec(dataset["id"], model=model["id"]))
    assert refused.status_code == 400, refused.text
    error = error_of(refused)
    assert error["param"] == "model" and "custom code (`auto_map`)" in str(error["message"])
    assert str(limited.data_dir) not in refused.text
    assert not marker.exists()


def test_model_files_read_at_submission_are_bounded(new_tenant: Tenant, tmp_path: Path) -> None:
    folder = make_tokenizer(tmp_path / "big")
    (folder / "vocab.txt").write_bytes(bytes(range(256)) * 300)  # 75 KiB, over the 64 KiB bound
    model = new_tenant.upload(_model_zip(folder), "model", "big.zip")
    dataset = new_tenant.upload(jsonl([record("hello world")]))
    refused = new_tenant.http.post("/v1/opd/jobs", json=new_tenant.spec(dataset["id"], model=model["id"]))
    assert refused.status_code == 400, refused.text
    assert error_of(refused)["param"] == "model"
    assert "OPD_MODEL_MAX_TOKENIZER_BYTES" in str(error_of(refused)["message"])


# -- rate limits ---------------------------------------------------------------------------------------


def test_a_key_past_its_rate_gets_429_with_retry_after_then_recovers(
    limited: Server, new_tenant: Tenant
) -> None:
    answers = [new_tenant.http.get("/v1/files") for _ in range(30)]
    statuses = [a.status_code for a in answers]
    assert statuses[:15] == [200] * 15 and 429 in statuses, statuses
    limited_answer = next(a for a in answers if a.status_code == 429)
    assert error_of(limited_answer)["code"] == "rate_limit_exceeded"
    assert "OPD_RATE_LIMIT_PER_S" in str(error_of(limited_answer)["message"])
    retry_after = int(limited_answer.headers["retry-after"])
    assert 1 <= retry_after <= 2
    # Health and metrics are exempt; another key has its own bucket.
    assert all(httpx.get(limited.url + path).status_code == 200 for path in ["/healthz", "/metrics"] * 15)
    other = create_key(limited.url, f"r-{uuid.uuid4().hex[:8]}")
    assert (
        httpx.get(limited.url + "/v1/files", headers={"Authorization": f"Bearer {other}"}).status_code == 200
    )
    time.sleep(retry_after)
    assert new_tenant.http.get("/v1/files").status_code == 200
    # The Python client waits out `Retry-After` by itself.
    while new_tenant.http.get("/v1/files").status_code == 200:
        pass
    assert new_tenant.client.list_files() == []


# -- event streams ---------------------------------------------------------------------------------------


def _sse(tenant: Tenant, job_id: str, after: int = 0) -> AbstractContextManager[httpx.Response]:
    path = f"/v1/opd/jobs/{job_id}/events"
    return tenant.http.stream("GET", path, params={"after": after}, headers={"Accept": "text/event-stream"})


def _sse_events(response: httpx.Response) -> list[tuple[str, dict[str, object]]]:
    found, kind = [], "message"
    for line in response.iter_lines():
        if line.startswith("event:"):
            kind = line.partition(":")[2].strip()
        elif line.startswith("data:"):
            found.append((kind, json.loads(line.partition(":")[2])))
            kind = "message"
    return found


def test_an_event_stream_ends_with_reconnect_at_its_longest(new_tenant: Tenant) -> None:
    job = new_tenant.job()  # queued for good: the scheduler is off, so its stream never ends by itself
    started = time.monotonic()
    with _sse(new_tenant, job["id"]) as response:
        assert response.status_code == 200
        events = _sse_events(response)
    elapsed = time.monotonic() - started
    assert 2 <= elapsed < 10, elapsed
    kinds = [kind for kind, _ in events]
    assert kinds == ["status", "status", "reconnect"], kinds
    assert events[-1][1] == {"id": job["id"], "after": events[1][1]["id"]}
    # Pages are bounded too.
    too_many = new_tenant.http.get(f"/v1/opd/jobs/{job['id']}/events", params={"limit": 1001})
    assert too_many.status_code == 422


def test_a_tenant_holds_a_bounded_number_of_streams(
    new_tenant: Tenant, other_tenant_on_limited: Tenant
) -> None:
    job = new_tenant.job()
    with ExitStack() as first, ExitStack() as second:
        assert first.enter_context(_sse(new_tenant, job["id"])).status_code == 200
        assert second.enter_context(_sse(new_tenant, job["id"])).status_code == 200
        path = f"/v1/opd/jobs/{job['id']}/events"
        third = new_tenant.http.get(path, headers={"Accept": "text/event-stream"})
        assert third.status_code == 429, third.text
        assert error_of(third)["code"] == "stream_limit_reached"
        assert "OPD_EVENT_STREAMS_PER_TENANT" in str(error_of(third)["message"])
        # Another tenant's streams are its own.
        other_job = other_tenant_on_limited.job()
        with _sse(other_tenant_on_limited, other_job["id"]) as other:
            assert other.status_code == 200
        first.close()
        # The slot comes back once the server sees the client leave.
        deadline = time.monotonic() + 10
        while True:
            with _sse(new_tenant, job["id"]) as again:
                if again.status_code == 200:
                    break
            assert time.monotonic() < deadline, "the closed stream's slot never came back"
            time.sleep(0.5)


def test_the_client_follows_a_job_across_reconnects(new_tenant: Tenant) -> None:
    job = new_tenant.job()
    cancel = threading.Timer(3.5, lambda: new_tenant.http.post(f"/v1/opd/jobs/{job['id']}/cancel"))
    cancel.start()
    try:
        items = list(new_tenant.client.stream_events(job["id"]))
    finally:
        cancel.cancel()
    events = [item for item in items if isinstance(item, EventPublic)]
    ids = [event.id for event in events]
    assert ids == sorted(set(ids))  # every event once, in order, across the reconnect
    assert [event.data.get("status") for event in events][-1] == "cancelled"
    assert isinstance(items[-1], StreamEnd) and items[-1].job is not None
    assert items[-1].job.status == "cancelled"
