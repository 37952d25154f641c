"""Python client of the OPD job server: files, jobs, events (incl. the SSE stream), keys, webhooks, and
`run(...)`.

    from opd_trainer.client import OPDClient
    client = OPDClient("http://127.0.0.1:8000", api_key="opd-...")
    job_id = client.run(job_name="demo", model="/models/student", teacher_model="/models/teacher",
                        training_datasets=["data/train.jsonl"], hyper_parameters={"max_steps": 40})
    for item in client.stream_events(job_id): print(item.type)  # each EventPublic, then a StreamEnd

Answers are the API's own pydantic models (`wire/schemas.py`: `JobPublic`, `FilePublic`, `EventPublic`,
...); list endpoints return lists of them, `iter_jobs` / `iter_events` page to the end. `run(...)` takes
the arguments of Bailian's `AgenticRL().run(...)`; local dataset files and workspace folders
(`fcmodel.zipdir`) are uploaded first and replaced by their file ids, since the server reads only what
was uploaded to it. Errors come back as `OPDAPIError` (an `OPDError`: `field` is the server's `param`).
`AsyncOPDClient` (`async_client.py`) is the same client for asyncio; both build their requests and
parse the answers with `operations.py` and `local_files.py`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Unpack

import httpx
from httpx_sse import connect_sse
from tenacity import Retrying

from opd_trainer.client import local_files, operations
from opd_trainer.client.local_files import RunArguments
from opd_trainer.client.operations import Call, ClientBase, Item, OPDAPIError, Page, StreamEnd
from opd_trainer.jobspec.job_spec import JobSpec
from opd_trainer.wire import schemas

__all__ = ["OPDAPIError", "OPDClient", "StreamEnd"]


class OPDClient(ClientBase[httpx.Client]):
    """One server, one tenant key, one `httpx.Client` (thread-safe as far as it is). The constructor's
    arguments are `ClientBase`'s: `base_url`, `api_key`, `timeout`, `retries`, `transport`."""

    _http_class = httpx.Client

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> OPDClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------------------

    def _send(self, call: Call[operations.T]) -> operations.T:
        """Sends `call` (again, under `operations.retry_policy`) and parses the answer."""
        retrying = Retrying(sleep=time.sleep, **operations.retry_policy(call.method, self.retries))
        response = retrying(lambda: self._http.send(call.request(self._http)))
        return call.parse(operations.checked(response))

    def _pages(self, call: Call[Page[Item]]) -> Iterator[Item]:
        page_call: Call[Page[Item]] | None = call
        while page_call is not None:
            page = self._send(page_call)
            yield from page.data
            page_call = operations.next_page(page_call, page)

    @staticmethod
    def _check_stream(response: httpx.Response) -> None:
        if response.status_code >= 400:
            response.read()
            raise operations.api_error(response)

    # -- keys -----------------------------------------------------------------------------------

    def create_key(self, tenant: str, admin_key: str) -> schemas.KeyPublic:
        """A new key for `tenant` (made on first use); needs the server's admin key. `key` holds the
        secret, shown this once."""
        return self._send(operations.create_key(tenant, admin_key))

    def list_keys(self, admin_key: str | None = None) -> list[schemas.KeyPublic]:
        """This tenant's keys (prefixes, never secrets); every tenant's with the admin key."""
        return self._send(operations.list_keys(admin_key))

    def usage(self, admin_key: str | None = None) -> list[schemas.TenantUsage]:
        """What this tenant's jobs used, added up (deleted jobs included); every tenant's with the admin
        key."""
        return self._send(operations.usage(admin_key))

    def revoke_key(self, key_id: str, admin_key: str) -> schemas.Deleted:
        """Revokes a tenant key at once; needs the server's admin key."""
        return self._send(operations.revoke_key(key_id, admin_key))

    # -- files ----------------------------------------------------------------------------------

    def upload_file(self, path: str | Path, purpose: schemas.FilePurpose = "dataset") -> schemas.FilePublic:
        """Uploads a dataset (JSONL), a workspace (folder or .zip) or a model (a Hugging Face model
        folder or its .zip; a job's `model` / `teacher_model` may then name the file id)."""
        with local_files.upload_source(path, purpose) as (filename, content):
            return self.upload_bytes(content, filename, purpose)

    def upload_bytes(self, content: Any, filename: str, purpose: schemas.FilePurpose) -> schemas.FilePublic:
        """Uploads `content` (bytes or a binary file object) as `filename`."""
        return self._send(operations.upload_file(filename, content, purpose))

    def list_files(self, purpose: schemas.FilePurpose | None = None) -> list[schemas.FilePublic]:
        return self._send(operations.list_files(purpose))

    def get_file(self, file_id: str) -> schemas.FilePublic:
        return self._send(operations.get_file(file_id))

    def delete_file(self, file_id: str) -> schemas.Deleted:
        return self._send(operations.delete_file(file_id))

    # -- jobs -----------------------------------------------------------------------------------

    def create_job(self, spec: dict[str, Any], dry_run: bool = False) -> schemas.JobPublic:
        """Submits a spec whose datasets/workspaces are already file ids. `dry_run`: a short calibration
        of it instead, whose `dry_run.estimate` says what the whole job would use once it succeeded."""
        return self._send(operations.create_job(spec, dry_run))

    def prepare_spec(self, spec: JobSpec) -> dict[str, Any]:
        """Uploads the spec's local datasets and workspace folders; returns it with file ids instead."""
        file_ids = {upload: self.upload_file(*upload).id for upload in local_files.uploads(spec)}
        return local_files.spec_with_file_ids(spec, file_ids.__getitem__)

    def submit(
        self, spec: JobSpec | dict[str, Any], base_dir: str | Path = ".", dry_run: bool = False
    ) -> schemas.JobPublic:
        """Validates locally, uploads local files (paths relative to `base_dir`), submits (`dry_run`: as
        `create_job`); returns the job."""
        return self.create_job(self.prepare_spec(local_files.parse_spec(spec, base_dir)), dry_run)

    def run(self, **arguments: Unpack[RunArguments]) -> str:
        """Bailian's `AgenticRL().run(...)` (`job_name`, `model`, `teacher_model`, `training_datasets`,
        `validation_datasets`, `functions`, `hyper_parameters`, `resources`, by keyword): submits the
        job (uploading local files) and returns its id.

        Datasets are paths, file ids or Bailian's `{data_source_type, file_name}` objects. The
        Bailian-shaped `AgenticRL` (`opd_trainer.client.agentic_rl`) wraps `AsyncOPDClient.run`.
        """
        return self.submit(local_files.run_spec(arguments)).id

    def list_jobs(
        self, status: str | None = None, limit: int = 20, after: str | None = None
    ) -> schemas.JobList:
        """One page of jobs, newest first (`has_more`: pass the last id as `after`)."""
        return self._send(operations.list_jobs(status, limit, after))

    def iter_jobs(self, status: str | None = None, page_size: int = 100) -> Iterator[schemas.JobPublic]:
        """Every job (newest first), fetching page after page."""
        return self._pages(operations.list_jobs(status, page_size, None))

    def get_job(self, job_id: str) -> schemas.JobPublic:
        return self._send(operations.get_job(job_id))

    def cancel_job(self, job_id: str) -> schemas.JobPublic:
        return self._send(operations.job_action(job_id, "cancel"))

    def pause_job(self, job_id: str) -> schemas.JobPublic:
        return self._send(operations.job_action(job_id, "pause"))

    def resume_job(self, job_id: str) -> schemas.JobPublic:
        return self._send(operations.job_action(job_id, "resume"))

    def delete_job(self, job_id: str) -> schemas.Deleted:
        return self._send(operations.delete_job(job_id))

    def events(self, job_id: str, after: int = 0, limit: int = 100) -> schemas.EventList:
        """One page of the job's events after `after`, oldest first."""
        return self._send(operations.events(job_id, after, limit))

    def iter_events(
        self, job_id: str, after: int = 0, page_size: int = 1000
    ) -> Iterator[schemas.EventPublic]:
        """Every event after `after` recorded so far, fetching page after page (`stream_events` follows)."""
        return self._pages(operations.events(job_id, after, page_size))

    def logs(self, job_id: str, after: int = 0) -> str:
        """The job's event log as text lines (what `opd logs` prints)."""
        return self._send(operations.logs(job_id, after))

    def checkpoints(self, job_id: str) -> list[schemas.CheckpointPublic]:
        return self._send(operations.checkpoints(job_id))

    def download_checkpoint(
        self,
        job_id: str,
        checkpoint_id: str | None = None,
        target: str | Path | None = None,
        merged: bool = False,
    ) -> Path:
        """Downloads a checkpoint's student (default: the job's `fine_tuned_model`) into `target`
        (default `./JOB_ID-CHECKPOINT_ID`, which must not exist) as a Hugging Face model folder; a LoRA
        job's is its adapter folder, or with `merged` the base model with the adapter merged in."""
        if checkpoint_id is None:
            checkpoint_id = local_files.fine_tuned_model(self.get_job(job_id))
        destination = local_files.download_target(job_id, checkpoint_id, target)
        call = operations.checkpoint_content(job_id, checkpoint_id, merged)
        with local_files.download_scratch(destination) as archive:
            with self._http.stream(call.method, call.path, **call.options()) as response:
                self._check_stream(response)
                with archive.open("wb") as sink:
                    for chunk in response.iter_bytes(local_files.DOWNLOAD_CHUNK):
                        sink.write(chunk)
            return local_files.unpack_checkpoint(archive, destination)

    def metrics(self, job_id: str) -> schemas.MetricsPublic:
        """`data`: the metrics.jsonl records; `summary`: validation of teacher, student before and after."""
        return self._send(operations.metrics(job_id))

    def trajectories(self, job_id: str, limit: int = 16) -> list[dict[str, Any]]:
        """Recent rollouts. Dicts: the API types a trajectory as a free-form object."""
        return self._send(operations.trajectories(job_id, limit))

    def validation_trajectories(
        self,
        job_id: str,
        *,
        step: int | None = None,
        label: str | None = None,
        model: str | None = None,
        sample_id: str | None = None,
        sort: schemas.ValidationTrajectorySort | None = None,
        order: Literal["desc", "asc"] | None = None,
        limit: int = 16,
        offset: int = 0,
    ) -> schemas.ValidationTrajectoryList:
        """Recorded validation rollouts (the first 16 of each pass) matching every filter given, as
        written or by `sort` (`score`, `reward`, `divergence`) and `order`; its `passes` lists every
        recorded pass (step, label, model)."""
        query = {"step": step, "label": label, "model": model, "sample_id": sample_id}
        query |= {"sort": sort, "order": order}
        return self._send(operations.validation_trajectories(job_id, query, limit, offset))

    # -- webhooks -------------------------------------------------------------------------------

    def create_webhook(
        self, url: str, events: list[str] | None = None, description: str = ""
    ) -> schemas.WebhookPublic:
        """Registers an endpoint for this tenant's job status changes (`events`: default all of
        `schemas.WEBHOOK_EVENT_TYPES`); `secret` signs every delivery and is shown this once
        (`opd_trainer.client.webhooks.verify_webhook` checks a delivery with it)."""
        return self._send(operations.create_webhook(url, events, description))

    def list_webhooks(self) -> list[schemas.WebhookPublic]:
        return self._send(operations.list_webhooks())

    def get_webhook(self, webhook_id: str) -> schemas.WebhookPublic:
        return self._send(operations.get_webhook(webhook_id))

    def delete_webhook(self, webhook_id: str) -> schemas.Deleted:
        return self._send(operations.delete_webhook(webhook_id))

    def webhook_deliveries(
        self, webhook_id: str, limit: int = 20, after: str | None = None, job_id: str | None = None
    ) -> schemas.WebhookDeliveryList:
        """One page of the endpoint's deliveries, newest first, each with its attempts."""
        return self._send(operations.webhook_deliveries(webhook_id, limit, after, job_id))

    def stream_events(
        self, job_id: str, after: int = 0, retries: int = 5
    ) -> Iterator[schemas.EventPublic | StreamEnd]:
        """The job's events as they happen (SSE), then one `StreamEnd` with the finished job.

        A dropped connection (or a server restarting) is reconnected after 2, 4, 8, then 10 s, from the
        last event received; more than `retries` failures in a row without an event raise.
        """
        follower = operations.EventFollower(job_id, after, retries)
        for attempt in Retrying(sleep=time.sleep, **follower.retrying()):
            with attempt:
                call = follower.call()
                with connect_sse(self._http, call.method, call.path, **call.options()) as source:
                    self._check_stream(source.response)
                    for sse in source.iter_sse():
                        yield from follower.items(sse.event, sse.data)
                        if follower.ended:
                            return
                return  # the server closed the stream without an end event: nothing more to follow

    def wait(self, job_id: str, poll_s: float = 2.0, timeout_s: float | None = None) -> schemas.JobPublic:
        """Polls until the job is finished; returns it. Past `timeout_s`, raises `TimeoutError`."""
        started = time.monotonic()
        while not operations.finished(job := self.get_job(job_id), time.monotonic() - started, timeout_s):
            time.sleep(poll_s)
        return job
