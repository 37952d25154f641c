"""Test helpers: a real `opd serve` process on a free port, and builders for datasets, zips, tokenizers."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from opd_trainer.client.api_client import OPDClient
from opd_trainer.cluster.ports import free_port

REPO = Path(__file__).resolve().parents[2]
ADMIN_KEY = "test-admin-key-0123456789"
TINY_MODELS_DIR = Path(os.environ.get("OPD_TINY_MODELS_DIR", REPO / ".cache" / "tiny-models"))


@dataclass
class Server:
    """One `opd serve` subprocess; `start()` again (after `kill` / `stop`) keeps its port, data dir and
    settings."""

    data_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    # OPD_MODEL_DIRS: the folders jobs may take models from (besides their own jobs' checkpoints).
    model_dirs: list[Path] = field(default_factory=lambda: [TINY_MODELS_DIR])
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_timeout: float = 120.0, wait_ready: bool = False) -> Server:
        env = {
            **os.environ,
            "OPD_ADMIN_KEY": ADMIN_KEY,
            "OPD_POLL_INTERVAL_S": "0.5",
            "OPD_MODEL_DIRS": json.dumps([str(folder) for folder in self.model_dirs]),
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}-server.log"
        log = self.log_path.open("ab")
        command = [sys.executable, "-m", "opd_trainer.cli", "serve", "--port", str(self.port)]
        command += ["--data-dir", str(self.data_dir), "--log-level", "warning"]
        # Own process group: a kill takes uvicorn and anything it started (an embedded Ray) with it.
        self.process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + ready_timeout
        path = "/readyz" if wait_ready else "/healthz"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if _answers_as_ours(httpx.get(self.url + path, timeout=2)):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {ready_timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:] if self.log_path else ""

    def kill(self) -> None:
        """SIGKILL, the way a crashed or evicted server dies."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def _answers_as_ours(response: httpx.Response) -> bool:
    """A 200 with the server's own health body: another process that took the port (a Ray process once
    answered a test's /readyz with 200) is not mistaken for the server."""
    try:
        return response.status_code == 200 and response.json().get("status") == "ok"
    except (ValueError, AttributeError):
        return False


def cancel_unfinished(client: OPDClient, job_id: str | None) -> None:
    """Cancels a job a failed test left queued or running, so it cannot hold a shared server's slot (the
    session's `training_server` runs one job at a time). Cleanup: it never raises over the test's error."""
    with contextlib.suppress(Exception):
        if job_id is not None and client.get_job(job_id).status not in ("succeeded", "failed", "cancelled"):
            client.cancel_job(job_id)


def create_key(server_url: str, tenant: str) -> str:
    response = httpx.post(
        server_url + "/v1/keys", json={"tenant": tenant}, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    response.raise_for_status()
    return str(response.json()["key"])


def record(user: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": user}], **extra}


def jsonl(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def zip_bytes(entries: dict[str, bytes], modes: dict[str, int] | None = None) -> bytes:
    """A zip with the given entries; `modes` sets unix mode bits (e.g. a symlink's 0o120777)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, content in entries.items():
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = (modes or {}).get(name, 0o100644) << 16
            archive.writestr(info, content)
    return buffer.getvalue()


WORKSPACE = {
    "functions/__init__.py": b"",
    "functions/reward.py": b"from opd_trainer.sdk import AbstractRewardProcessor\n\n"
    b"class MyReward(AbstractRewardProcessor):\n    async def process(self, reward_input):\n        ...\n",
}


MODEL_CONTEXT = 4096


def make_tokenizer(
    folder: Path, words: str = "hello world user assistant", config_extra: dict[str, Any] | None = None
) -> Path:
    """A tiny real Hugging Face tokenizer folder, plus the `config.json` entry the server's pre-flight
    reads (the context length, which bounds max_length); enough for every pre-flight but the engines."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<|im_end|>": 1, **{w: i + 2 for i, w in enumerate(words.split())}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="<|im_end|>")
    fast.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}<|im_end|>{% endfor %}"
    fast.save_pretrained(str(folder))
    config = {**(config_extra or {}), "max_position_embeddings": MODEL_CONTEXT}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def make_shaped_model(folder: Path) -> Path:
    """`make_tokenizer`'s folder with a real decoder's config and weights (a 2-layer Qwen2 of 16-wide
    layers): what the memory plan and the LoRA pre-flight read (its shape, its weight names)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=MODEL_CONTEXT,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    return make_tokenizer(folder, config_extra=config.to_dict())


@dataclass
class Tenant:
    """A fresh tenant on the shared server: its key, a raw httpx client and the Python client."""

    name: str
    key: str
    http: httpx.Client
    client: OPDClient
    models: dict[str, str]

    def upload(
        self, content: bytes, purpose: str = "dataset", filename: str = "data.jsonl"
    ) -> dict[str, Any]:
        response = self.http.post("/v1/files", files={"file": (filename, content)}, data={"purpose": purpose})
        assert response.status_code == 201, response.text
        return response.json()

    def spec(self, dataset_id: str, **overrides: Any) -> dict[str, Any]:
        spec = {
            "job_name": "api-test",
            "model": self.models["student"],
            "teacher_model": self.models["teacher"],
            "training_datasets": [dataset_id],
            "hyper_parameters": {"max_steps": 3, "batch_size": 2},
        }
        spec.update(overrides)
        return spec

    def job(self, **overrides: Any) -> dict[str, Any]:
        """A queued job over a fresh one-record dataset."""
        dataset = self.upload(jsonl([record("hello world")]))
        response = self.http.post("/v1/opd/jobs", json=self.spec(dataset["id"], **overrides))
        assert response.status_code == 201, response.text
        return response.json()


def make_tenant(server: Server, models: dict[str, str]) -> Iterator[Tenant]:
    """A fresh tenant on `server` (its own key, quota and rate bucket); closes its clients after."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    key = create_key(server.url, name)
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    client = OPDClient(server.url, key)
    yield Tenant(name, key, http, client, models)
    http.close()
    client.close()


def wait_for_job(client: OPDClient, job_id: str, done: Any, timeout_s: float, poll_s: float = 0.5) -> Any:
    """The job once `done(job)` holds, asked every `poll_s`; TimeoutError naming its status after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get_job(job_id)
        if done(job):
            return job
        time.sleep(poll_s)
    raise TimeoutError(f"job {job_id} still {client.get_job(job_id).status}")
