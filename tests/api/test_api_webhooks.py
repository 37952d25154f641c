"""Webhooks over real HTTP: the job server app under uvicorn (SQLite file, scheduler off: job status
changes come from pause and cancel of queued jobs) and a local receiver on 127.0.0.1, allowed by
OPD_WEBHOOK_ALLOWED_HOSTS.

Signatures verify with the endpoint's secret; a 500 is retried, then delivered; a job's events arrive in
order; a delivery written before the server is killed arrives after its restart; internal URLs are
refused naming `url`; another tenant neither sees nor deletes an endpoint.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from apiserver import ADMIN_KEY, Tenant, jsonl, make_tenant, record

from api.main import create_app
from api.settings import Settings
from opd_trainer.cli.main import main
from opd_trainer.client import AsyncOPDClient
from opd_trainer.client.webhooks import verify_webhook
from opd_trainer.cluster.ports import free_port


class Receiver:
    """An HTTP receiver on 127.0.0.1 that records every request. A path containing `fail-once`
    answers 500 to its first request; while `down` is set, every request gets a 503."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.down = False
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver.lock:
                    earlier = [r for r in receiver.requests if r[0] == self.path]
                    receiver.requests.append(
                        (self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                    )
                failing = receiver.down or ("fail-once" in self.path and not earlier)
                self.send_response(503 if receiver.down else 500 if failing else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}-{uuid.uuid4().hex[:8]}"

    def at(self, url: str) -> list[tuple[dict[str, str], bytes]]:
        path = "/" + url.split("/", 3)[3]
        with self.lock:
            return [(headers, body) for p, headers, body in self.requests if p == path]


def wait_for(condition: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError("timed out waiting")


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    found = Receiver()
    yield found
    found.server.shutdown()


class AppServer:
    """The job server app (`api.main.create_app`) under uvicorn in a thread of this process, on a real
    port and a SQLite file; `stop()` then `start()` is a server restart on the same data dir.

    In this process, not `opd serve`'s: a start imports transformers (pre-flight), which takes most of a
    minute on a busy 2-core machine, and a restart here does not import it again.
    """

    def __init__(self, data_dir: Path, **settings: Any) -> None:
        self.data_dir = data_dir
        self.settings = settings
        self.port = free_port()
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> AppServer:
        settings = Settings(data_dir=self.data_dir, admin_key=ADMIN_KEY, **self.settings)
        config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="webhook-test-server", daemon=True)
        self.thread.start()
        wait_for(lambda: self.server is not None and self.server.started, 300)
        return self

    def stop(self) -> None:
        if self.server is not None and self.thread is not None:
            self.server.should_exit = True
            self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def hook_server(
    tmp_path_factory: pytest.TempPathFactory, receiver: Receiver, models_root: Path
) -> Iterator[AppServer]:
    server = AppServer(
        tmp_path_factory.mktemp("webhooks") / "data",
        max_concurrent_jobs=0,
        model_dirs=[models_root],
        rate_limit_per_s=0,
        webhook_allowed_hosts=[f"127.0.0.1:{receiver.port}"],
        webhook_poll_interval_s=0.1,
        webhook_backoff_base_s=0.2,
        webhook_backoff_cap_s=0.5,
        webhook_timeout_s=2,
    ).start()
    yield server
    server.stop()


@pytest.fixture
def owner(hook_server: AppServer, models: dict[str, str]) -> Iterator[Tenant]:
    yield from make_tenant(hook_server, models)


@pytest.fixture
def stranger(hook_server: AppServer, models: dict[str, str]) -> Iterator[Tenant]:
    yield from make_tenant(hook_server, models)


def _job(tenant: Tenant) -> dict[str, Any]:
    """A queued job (the scheduler is off: it stays queued until paused or cancelled)."""
    dataset = tenant.upload(jsonl([record("hello world")]))
    spec = tenant.spec(dataset["id"], validation_datasets=[dataset["id"]])
    response = tenant.http.post("/v1/opd/jobs", json=spec)
    assert response.status_code == 201, response.text
    return dict(response.json())


def _create(tenant: Tenant, url: str, **body: Any) -> dict[str, Any]:
    response = tenant.http.post("/v1/opd/webhooks", json={"url": url, **body})
    assert response.status_code == 201, response.text
    return response.json()


def test_endpoints_belong_to_their_tenant_and_show_the_secret_once(
    hook_server: AppServer,
    receiver: Receiver,
    owner: Tenant,
    stranger: Tenant,
    capsys: pytest.CaptureFixture[str],
) -> None:
    created = _create(owner, receiver.url("crud"), events=["job.succeeded", "job.failed"], description="ci")
    assert created["secret"].startswith("whsec_") and created["events"] == ["job.succeeded", "job.failed"]
    listed = owner.client.list_webhooks()
    assert [(w.id, w.secret) for w in listed] == [(created["id"], None)]
    assert owner.client.get_webhook(created["id"]).description == "ci"
    # Another tenant: not listed, not readable, not deletable, no log.
    assert stranger.client.list_webhooks() == []
    for method, path in [
        ("GET", f"/v1/opd/webhooks/{created['id']}"),
        ("DELETE", f"/v1/opd/webhooks/{created['id']}"),
        ("GET", f"/v1/opd/webhooks/{created['id']}/deliveries"),
    ]:
        response = stranger.http.request(method, path)
        assert response.status_code == 404 and response.json()["error"]["param"] == "webhook_id"
    # The async client and the CLI reach the same routes.
    assert [w.id for w in asyncio.run(_async_list(hook_server, owner))] == [created["id"]]
    connection = ["--base-url", hook_server.url, "--api-key", owner.key]
    assert main(["webhooks", "list", *connection]) == 0
    assert created["id"] in capsys.readouterr().out
    assert main(["webhooks", "create", "https://10.1.2.3/hook", *connection]) == 2
    assert "url" in capsys.readouterr().err
    assert main(["webhooks", "delete", created["id"], *connection]) == 0
    assert owner.client.list_webhooks() == []


async def _async_list(server: AppServer, tenant: Tenant) -> list[Any]:
    async with AsyncOPDClient(server.url, tenant.key) as client:
        return await client.list_webhooks()


def test_internal_and_malformed_urls_are_refused_naming_url(receiver: Receiver, owner: Tenant) -> None:
    refused = [
        f"http://127.0.0.1:{receiver.port + 1 if receiver.port < 65535 else 1}/x",  # not the allowed port
        "https://127.0.0.1/x",
        "https://10.0.0.1/x",
        "https://169.254.169.254/latest/meta-data/",
        "https://localhost/x",  # a name that resolves to loopback
        "https://[::1]/x",
        "http://93.184.216.34/x",  # public, but not https
        "ftp://example.com/x",
        "not a url",
    ]
    for url in refused:
        response = owner.http.post("/v1/opd/webhooks", json={"url": url})
        assert response.status_code == 400, (url, response.text)
        assert response.json()["error"]["param"] == "url", url
    bad_events = owner.http.post(
        "/v1/opd/webhooks", json={"url": receiver.url("x"), "events": ["job.exploded"]}
    )
    assert bad_events.status_code == 422 and bad_events.json()["error"]["param"] == "events.0"
    assert owner.client.list_webhooks() == []
    # Public https is accepted (nothing is sent to it here), and so is the receiver the operator allows.
    _create(owner, "https://93.184.216.34/hook")
    _create(owner, receiver.url("allowed"))


def test_deliveries_are_signed_retried_after_a_500_and_in_order_per_job(
    receiver: Receiver, owner: Tenant
) -> None:
    url = receiver.url("fail-once")
    hook = _create(owner, url)
    job = _job(owner)
    assert owner.http.post(f"/v1/opd/jobs/{job['id']}/pause").json()["status"] == "paused"
    assert owner.http.post(f"/v1/opd/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
    arrived = wait_for(lambda: (found := receiver.at(url)) and len(found) >= 3 and found)
    events = [verify_webhook(hook["secret"], headers, body) for headers, body in arrived]
    # The first attempt got a 500; job.cancelled waited for job.paused to be delivered.
    assert [e["type"] for e in events] == ["job.paused", "job.paused", "job.cancelled"]
    assert arrived[0][0]["webhook-id"] == arrived[1][0]["webhook-id"] != arrived[2][0]["webhook-id"]
    cancelled = events[-1]["data"]
    assert cancelled["id"] == job["id"] and cancelled["status"] == "cancelled"
    assert cancelled["finished_at"] is not None and cancelled["fine_tuned_model"] is None
    log = wait_for(
        lambda: (page := owner.client.webhook_deliveries(hook["id"])).data[0].status == "delivered" and page
    )
    assert [(d.event_type, d.status) for d in log.data] == [
        ("job.cancelled", "delivered"),
        ("job.paused", "delivered"),
    ]
    assert [a.status_code for a in log.data[1].attempts] == [500, 200]
    assert all(a.duration_ms >= 0 for d in log.data for a in d.attempts)
    assert owner.client.webhook_deliveries(hook["id"], job_id="opdjob-other").data == []
    assert len(receiver.at(url)) == 3  # nothing sent twice


def test_a_delivery_written_before_a_restart_arrives_after_it(
    hook_server: AppServer, receiver: Receiver, owner: Tenant
) -> None:
    url = receiver.url("restart")
    hook = _create(owner, url, events=["job.cancelled"])
    receiver.down = True
    try:
        job = _job(owner)
        owner.http.post(f"/v1/opd/jobs/{job['id']}/cancel")
        wait_for(lambda: receiver.at(url))  # tried, answered 503: still pending
        hook_server.stop()  # the deliverer stops with it, its attempt in flight (if any) cut short
    finally:
        receiver.down = False
    tried_before = len(receiver.at(url))
    hook_server.start()
    # A claim the stop left behind (an attempt cut short) expires after the attempt's timeout and a
    # margin (12 s here).
    arrived = wait_for(lambda: (found := receiver.at(url)) and len(found) > tried_before and found, 40)
    event = verify_webhook(hook["secret"], *arrived[-1])
    assert event["type"] == "job.cancelled" and event["data"]["id"] == job["id"]

    def delivered() -> dict[str, Any] | None:
        page = httpx.get(
            f"{hook_server.url}/v1/opd/webhooks/{hook['id']}/deliveries",
            headers={"Authorization": f"Bearer {owner.key}"},
        ).json()
        return page if page["data"][0]["status"] == "delivered" else None

    codes = [a["status_code"] for a in wait_for(delivered)["data"][0]["attempts"]]
    # An attempt the stop cut short is not logged: the receiver may have seen one 503 more.
    assert codes[-1] == 200 and 1 <= len(codes) - 1 <= tried_before and set(codes[:-1]) == {503}
