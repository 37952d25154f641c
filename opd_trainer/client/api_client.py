"""Python client of the OPD job server: files, jobs, events (incl. the SSE stream), keys, and `run(...)`.

    from opd_trainer.client.api_client import OPDClient
    client = OPDClient("http://127.0.0.1:8000", api_key="opd-...")
    job_id = client.run(job_name="demo", model="/models/student", teacher_model="/models/teacher",
                        training_datasets=["data/train.jsonl"], hyper_parameters={"max_steps": 40})
    for event in client.stream_events(job_id): print(event["message"])

`run(...)` takes the arguments of Bailian's `AgenticRL().run(...)`; local dataset files and workspace
folders (`fcmodel.zipdir`) are uploaded first and replaced by their file ids, since the server reads
only what was uploaded to it. Errors come back as `OPDAPIError` (an `OPDError`: `field` is the
server's `param`).
"""

from __future__ import annotations

import os
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import connect_sse
from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_exponential

from opd_trainer.errors import ConfigError, OPDError
from opd_trainer.folder_zip import stream_zip
from opd_trainer.spec.job_spec import JobSpec, parse_job_spec, resolve_paths
from opd_trainer.spec.job_status import TERMINAL
from opd_trainer.workers.workspace import check_zip, extract_zip, pack_workspace

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DOWNLOAD_CHUNK = 1024 * 1024
# What a downloaded checkpoint may expand to: a model folder (weights are stored, not compressed).
MODEL_MAX_FILES = 10_000
MODEL_MAX_BYTES = 4 * 1024**4
MODEL_MAX_RATIO = 1000.0


class OPDAPIError(OPDError):
    """The server answered with an error: `status`, `code`, and `field` (the server's `param`)."""

    def __init__(self, message: str, *, field: str | None = None, status: int = 0, code: str = "") -> None:
        super().__init__(message, field=field)
        self.status = status
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            self.__class__,
            (self.message,),
            {"field": self.field, "status": self.status, "code": self.code},
        )


class OPDClient:
    """One server, one tenant key. Thread-safe as far as `httpx.Client` is."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = 120.0,
        retries: int = 3,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """`retries`: how often a request is sent again (backoff 0.5, 1, 2, 4 s..., or the server's
        `Retry-After`) after a 503, a 429 that says when to come back (`Retry-After`), a 502 or 504, or
        a connection failure; a request that changes something only when the server cannot have acted
        on it (refused connection, 429, 503)."""
        self.base_url = (base_url or os.environ.get("OPD_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("OPD_API_KEY")
        self.retries = retries
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> OPDClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        idempotent = method in IDEMPOTENT_METHODS
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                response = self._http.request(method, path, **kwargs)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                if last:
                    raise
                time.sleep(_backoff(attempt))
                continue
            except httpx.TransportError:  # sent, then lost: only a read may be repeated safely
                if last or not idempotent:
                    raise
                time.sleep(_backoff(attempt))
                continue
            retry = response.status_code in (RETRY_ALWAYS if not idempotent else RETRY_IDEMPOTENT)
            if response.status_code == 429 and _retry_after(response) is None:
                retry = False  # a limit (e.g. the tenant's active jobs), not a request to slow down
            if retry and not last:
                time.sleep(_retry_after(response) or _backoff(attempt))
                continue
            if response.status_code >= 400:
                raise _api_error(response)
            return response
        raise AssertionError("unreachable")

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._request(method, path, **kwargs).json()

    # -- keys -----------------------------------------------------------------------------------

    def create_key(self, tenant: str, admin_key: str) -> dict[str, Any]:
        """A new key for `tenant` (made on first use); needs the server's admin key."""
        headers = {"Authorization": f"Bearer {admin_key}"}
        return self._json("POST", "/v1/keys", json={"tenant": tenant}, headers=headers)

    def list_keys(self, admin_key: str | None = None) -> list[dict[str, Any]]:
        """This tenant's keys (prefixes, never secrets); every tenant's with the admin key."""
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        return self._json("GET", "/v1/keys", headers=headers)["data"]

    def revoke_key(self, key_id: str, admin_key: str) -> dict[str, Any]:
        """Revokes a tenant key at once; needs the server's admin key."""
        headers = {"Authorization": f"Bearer {admin_key}"}
        return self._json("DELETE", f"/v1/keys/{key_id}", headers=headers)

    # -- files ----------------------------------------------------------------------------------

    def upload_file(self, path: str | Path, purpose: str = "dataset") -> dict[str, Any]:
        """Uploads a dataset (JSONL), a workspace (folder or .zip) or a model (a Hugging Face model
        folder or its .zip; a job's `model` / `teacher_model` may then name the file id)."""
        path = Path(path)
        if purpose == "workspace" and path.is_dir():
            return self.upload_bytes(
                pack_workspace(path), f"{path.resolve().name or 'workspace'}.zip", purpose
            )
        if purpose == "model" and path.is_dir():
            with tempfile.TemporaryDirectory(prefix="opd-model-upload-") as scratch:
                name = path.resolve().name or "model"
                archive = Path(scratch) / f"{name}.zip"
                with archive.open("wb") as sink:  # on disk, stored: a model is not held in memory
                    for chunk in stream_zip(path, name):
                        sink.write(chunk)
                return self.upload_file(archive, purpose)
        with path.open("rb") as handle:
            files = {"file": (path.name, handle)}
            return self._json("POST", "/v1/files", files=files, data={"purpose": purpose})

    def upload_bytes(self, content: bytes, filename: str, purpose: str) -> dict[str, Any]:
        files = {"file": (filename, content)}
        return self._json("POST", "/v1/files", files=files, data={"purpose": purpose})

    def list_files(self, purpose: str | None = None) -> list[dict[str, Any]]:
        params = {"purpose": purpose} if purpose else {}
        return self._json("GET", "/v1/files", params=params)["data"]

    def get_file(self, file_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/files/{file_id}")

    def delete_file(self, file_id: str) -> dict[str, Any]:
        return self._json("DELETE", f"/v1/files/{file_id}")

    # -- jobs -----------------------------------------------------------------------------------

    def create_job(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Submits a spec whose datasets/workspaces are already file ids."""
        return self._json("POST", "/v1/opd/jobs", json=spec)

    def prepare_spec(self, spec: JobSpec) -> dict[str, Any]:
        """Uploads the spec's local datasets and workspace folders; returns it with file ids instead."""
        uploaded: dict[tuple[str, str], str] = {}

        def upload(value: str, purpose: str) -> str:
            key = (str(Path(value).resolve()), purpose)
            if key not in uploaded:
                uploaded[key] = self.upload_file(value, purpose)["id"]
            return uploaded[key]

        def dataset(value: str, field: str) -> str:
            if Path(value).is_file():
                return upload(value, "dataset")
            if value.startswith("file-"):
                return value  # already uploaded
            raise ConfigError(f"{value} is neither a local file nor a file id", field=field)

        data = spec.model_dump(mode="json", exclude_none=True)
        for name in ("training_datasets", "validation_datasets"):
            data[name] = [dataset(d, f"{name}.{i}") for i, d in enumerate(getattr(spec, name))]
        for entry, component in zip(data["functions"], spec.functions, strict=True):
            zipdir = component.fcmodel.zipdir
            if zipdir is None:
                continue
            if not Path(zipdir).exists():
                raise ConfigError(
                    f"{zipdir} does not exist", field=f"functions.{component.name}.fcmodel.zipdir"
                )
            entry["fcmodel"] = {
                "workspace": upload(zipdir, "workspace"),
                "classpath": component.fcmodel.classpath,
            }
        return data

    def submit(self, spec: JobSpec | dict[str, Any], base_dir: str | Path = ".") -> dict[str, Any]:
        """Validates locally, uploads local files (paths relative to `base_dir`), submits; returns the job."""
        parsed = spec if isinstance(spec, JobSpec) else parse_job_spec(spec)
        return self.create_job(self.prepare_spec(resolve_paths(parsed, Path(base_dir))))

    def run(
        self,
        job_name: str,
        model: str,
        teacher_model: str,
        training_datasets: list[str | dict[str, Any]],
        validation_datasets: list[str | dict[str, Any]] | None = None,
        functions: list[dict[str, Any]] | None = None,
        hyper_parameters: dict[str, Any] | None = None,
        resources: dict[str, Any] | None = None,
    ) -> str:
        """Bailian's `AgenticRL().run(...)`: submits the job (uploading local files) and returns its id.

        Datasets are paths, file ids or Bailian's `{data_source_type, file_name}` objects. The async,
        Bailian-shaped `AgenticRL` (`opd_trainer.client.agentic_rl`) runs this in a thread.
        """
        spec: dict[str, Any] = {
            "job_name": job_name,
            "model": model,
            "teacher_model": teacher_model,
            "training_datasets": list(training_datasets),
            "validation_datasets": list(validation_datasets or []),
            "functions": list(functions or []),
            "hyper_parameters": dict(hyper_parameters or {}),
        }
        if resources is not None:
            spec["resources"] = resources
        return self.submit(spec)["id"]

    def list_jobs(
        self, status: str | None = None, limit: int = 20, after: str | None = None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if status:
            params["status"] = status
        if after:
            params["after"] = after
        return self._json("GET", "/v1/opd/jobs", params=params)

    def iter_jobs(self, status: str | None = None, page_size: int = 100) -> Iterator[dict[str, Any]]:
        """Every job (newest first), fetching page after page."""
        after = None
        while True:
            page = self.list_jobs(status=status, limit=page_size, after=after)
            yield from page["data"]
            if not page["has_more"] or not page["data"]:
                return
            after = page["data"][-1]["id"]

    def get_job(self, job_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/opd/jobs/{job_id}")

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        return self._json("POST", f"/v1/opd/jobs/{job_id}/cancel")

    def pause_job(self, job_id: str) -> dict[str, Any]:
        return self._json("POST", f"/v1/opd/jobs/{job_id}/pause")

    def resume_job(self, job_id: str) -> dict[str, Any]:
        return self._json("POST", f"/v1/opd/jobs/{job_id}/resume")

    def delete_job(self, job_id: str) -> dict[str, Any]:
        return self._json("DELETE", f"/v1/opd/jobs/{job_id}")

    def events(self, job_id: str, after: int = 0, limit: int = 100) -> dict[str, Any]:
        return self._json("GET", f"/v1/opd/jobs/{job_id}/events", params={"after": after, "limit": limit})

    def iter_events(self, job_id: str, after: int = 0, page_size: int = 1000) -> Iterator[dict[str, Any]]:
        """Every event after `after` recorded so far, fetching page after page (`stream_events` follows)."""
        while True:
            page = self.events(job_id, after=after, limit=page_size)
            yield from page["data"]
            if not page["has_more"] or not page["data"]:
                return
            after = page["data"][-1]["id"]

    def logs(self, job_id: str, after: int = 0) -> str:
        return self._request("GET", f"/v1/opd/jobs/{job_id}/logs", params={"after": after}).text

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return self._json("GET", f"/v1/opd/jobs/{job_id}/checkpoints")["data"]

    def download_checkpoint(
        self, job_id: str, checkpoint_id: str | None = None, target: str | Path | None = None
    ) -> Path:
        """Downloads a checkpoint's student (default: the job's `fine_tuned_model`) into `target`
        (default `./JOB_ID-CHECKPOINT_ID`, which must not exist) as a Hugging Face model folder."""
        if checkpoint_id is None:
            job = self.get_job(job_id)
            checkpoint_id = job.get("fine_tuned_model")
            if not checkpoint_id:
                raise ConfigError(
                    f"job {job_id} has no fine_tuned_model ({job['status']}); name a checkpoint "
                    "from its checkpoint list",
                    field="checkpoint_id",
                )
        destination = Path(target) if target is not None else Path(f"{job_id}-{checkpoint_id}")
        if destination.exists():
            raise ConfigError(f"{destination} already exists", field="target")
        destination.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=destination.parent, prefix=".download-") as scratch:
            archive_path = Path(scratch) / "checkpoint.zip"
            path = f"/v1/opd/jobs/{job_id}/checkpoints/{checkpoint_id}/content"
            with self._http.stream("GET", path, timeout=httpx.Timeout(60.0, read=None)) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _api_error(response)
                with archive_path.open("wb") as sink:
                    for chunk in response.iter_bytes(DOWNLOAD_CHUNK):
                        sink.write(chunk)
            with zipfile.ZipFile(archive_path) as archive:
                infos = check_zip(
                    archive,
                    max_files=MODEL_MAX_FILES,
                    max_uncompressed=MODEL_MAX_BYTES,
                    max_ratio=MODEL_MAX_RATIO,
                    field="checkpoint",
                )
                extract_zip(archive, infos, Path(scratch) / "model", field="checkpoint")
            [top] = list((Path(scratch) / "model").iterdir())  # the archive's one top folder
            top.rename(destination)
        return destination

    def metrics(self, job_id: str) -> dict[str, Any]:
        """`{"data": [metrics.jsonl records], "summary": {teacher, student_before, student_after}}`."""
        return self._json("GET", f"/v1/opd/jobs/{job_id}/metrics")

    def trajectories(self, job_id: str, limit: int = 16) -> list[dict[str, Any]]:
        return self._json("GET", f"/v1/opd/jobs/{job_id}/trajectories", params={"limit": limit})["data"]

    def stream_events(self, job_id: str, after: int = 0, retries: int = 5) -> Iterator[dict[str, Any]]:
        """Events as they happen (SSE), then one `{"type": "end", "job": {...}}`.

        A dropped connection (or a server restarting) is reconnected after 2, 4, 8, then 10 s, from the
        last event received; more than `retries` failures in a row without an event raise.
        """
        failures = 0

        def give_up(_: RetryCallState) -> bool:
            nonlocal failures
            failures += 1
            return failures > retries

        reconnects = Retrying(
            retry=retry_if_exception_type(httpx.TransportError),
            stop=give_up,
            wait=wait_exponential(multiplier=2, max=10),
            reraise=True,
        )
        for attempt in reconnects:
            with attempt:
                for kind, data in self._sse(job_id, after):
                    failures = 0
                    if kind == "end":
                        yield {"type": "end", "job": data}
                        return
                    if kind == "shutdown":  # the server is restarting: reconnect like after a drop
                        raise httpx.RemoteProtocolError("the server shut down the event stream")
                    after = max(after, int(data["id"]))
                    yield data
                return  # the server closed the stream without an end event: nothing more to follow

    def _sse(self, job_id: str, after: int) -> Iterator[tuple[str, Any]]:
        headers = {"Accept": "text/event-stream", "Last-Event-ID": str(after)}
        timeout = httpx.Timeout(30.0, read=None)  # the stream may be quiet for long stretches
        with connect_sse(
            self._http,
            "GET",
            f"/v1/opd/jobs/{job_id}/events",
            headers=headers,
            params={"after": after},
            timeout=timeout,
        ) as source:
            if source.response.status_code >= 400:
                source.response.read()
                raise _api_error(source.response)
            for event in source.iter_sse():
                if event.data:
                    yield event.event, event.json()

    def wait(self, job_id: str, poll_s: float = 2.0, timeout_s: float | None = None) -> dict[str, Any]:
        """Polls until the job is finished; returns it."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            job = self.get_job(job_id)
            if job["status"] in TERMINAL:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['status']} after {timeout_s}s")
            time.sleep(poll_s)


IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "DELETE"})
# Statuses after which the server has done nothing: any request may be sent again.
RETRY_ALWAYS = frozenset({429, 503})
# A gateway error may come after the server acted: only idempotent requests are sent again.
RETRY_IDEMPOTENT = RETRY_ALWAYS | {502, 504}
MAX_BACKOFF_S = 8.0


def _backoff(attempt: int) -> float:
    return float(min(MAX_BACKOFF_S, 0.5 * 2**attempt))


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After", "")
    return min(float(value), 60.0) if value.replace(".", "", 1).isdigit() else None


def _api_error(response: httpx.Response) -> OPDAPIError:
    try:
        error = response.json()["error"]
        return OPDAPIError(
            str(error.get("message")),
            field=error.get("param"),
            status=response.status_code,
            code=error["code"],
        )
    except (ValueError, KeyError, TypeError):
        text = response.text[:500] or response.reason_phrase
        return OPDAPIError(
            f"HTTP {response.status_code}: {text}", status=response.status_code, code="http_error"
        )
