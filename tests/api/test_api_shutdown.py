"""SIGTERM with an event stream open: the stream ends with a `shutdown` event and the server exits
promptly (uvicorn alone waits for open streams forever). SIGKILL: no process of its embedded Ray is
left behind."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
from apiserver import Server, create_key, jsonl, record


def test_sigterm_closes_open_event_streams_and_the_server_exits(tmp_path: Path, models_root: Path) -> None:
    from apiserver import make_tokenizer

    model = str(make_tokenizer(models_root / "shutdown-student"))
    server = Server(tmp_path / "data", env={"OPD_MAX_CONCURRENT_JOBS": "0"}, model_dirs=[models_root]).start()
    try:
        http = httpx.Client(
            base_url=server.url,
            headers={"Authorization": f"Bearer {create_key(server.url, 'stream')}"},
            timeout=60,
        )
        dataset = http.post(
            "/v1/files", files={"file": ("d.jsonl", jsonl([record()]))}, data={"purpose": "dataset"}
        )
        spec = {
            "job_name": "s",
            "model": model,
            "teacher_model": model,
            "training_datasets": [dataset.json()["id"]],
        }
        job = http.post("/v1/opd/jobs", json=spec).json()
        received: list[str] = []

        def follow() -> None:  # a queued job: the stream would stay open for as long as the job waits
            headers = {"Accept": "text/event-stream"}
            with http.stream(
                "GET", f"/v1/opd/jobs/{job['id']}/events", headers=headers, timeout=60
            ) as response:
                received.extend(line for line in response.iter_lines() if line.startswith("event:"))

        reader = threading.Thread(target=follow)
        reader.start()
        time.sleep(2)  # the stream is open and idle
        assert server.process is not None
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=20)
        reader.join(timeout=10)
        assert time.monotonic() - started < 12, "the server waited for the open stream"
        assert not reader.is_alive() and received[-1] == "event: shutdown", received
    finally:
        server.kill()


def test_no_process_of_the_embedded_ray_outlives_a_sigkilled_server(
    tmp_path: Path, models_root: Path
) -> None:
    import os

    import psutil

    server = Server(tmp_path / "data", env={"OPD_MAX_CONCURRENT_JOBS": "1"}, model_dirs=[models_root])
    server.start(ready_timeout=300, wait_ready=True)  # ready: the scheduler started its local Ray
    try:
        assert server.process is not None
        main = psutil.Process(server.process.pid)
        ray_processes = [
            p for p in main.children(recursive=True) if "ray_reaper" not in " ".join(p.cmdline())
        ]
        assert any("raylet" in " ".join(p.cmdline()) for p in ray_processes)
        os.kill(server.process.pid, signal.SIGKILL)  # the server alone, as the OOM killer would
        server.process.wait(timeout=30)

        def alive() -> list[str]:
            left = []
            for process in ray_processes:
                try:
                    if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                        left.append(" ".join(process.cmdline())[:120])
                except psutil.NoSuchProcess:
                    continue
            return left

        deadline = time.monotonic() + 60
        while alive() and time.monotonic() < deadline:
            time.sleep(1)
        assert alive() == []
    finally:
        server.kill()
