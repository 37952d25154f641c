"""`AsyncOPDClient`: the job server's Python client for asyncio, beside the synchronous `OPDClient`.

    import asyncio
    from pathlib import Path
    from opd_trainer.client import AsyncOPDClient, StreamEnd
    from opd_trainer.jobspec.job_spec import load_job_spec

    async def main() -> None:
        async with AsyncOPDClient("http://127.0.0.1:8000", api_key="opd-...") as client:
            job = await client.submit(load_job_spec(Path("job.yaml")))  # uploads its local files
            async for item in client.stream_events(job.id):
                if isinstance(item, StreamEnd):
                    print("finished:", item.job.status if item.job else "deleted")
                else:
                    print(item.type, item.message)

    asyncio.run(main())

The methods, arguments and answers (the API's pydantic models) are `OPDClient`'s, awaited; the paging
iterators (`iter_jobs`, `iter_events`) and `stream_events` are async iterators. Requests are built,
retried (tenacity's `AsyncRetrying`) and parsed by the same `operations.py` as the synchronous client,
and files prepared by the same `local_files.py`; zipping a folder for upload and unpacking a downloaded
checkpoint run in a worker thread, and a spec's local files are uploaded concurrently.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Literal, Unpack

import httpx
from httpx_sse import aconnect_sse
from tenacity import AsyncRetrying

from opd_trainer.client import local_files, operations
from opd_trainer.client.local_files import RunArguments
from opd_trainer.client.operations import Call, ClientBase, Item, Page, StreamEnd
from opd_trainer.jobspec.job_spec import JobSpec
from opd_trainer.wire import schemas


class AsyncOPDClient(ClientBase[httpx.AsyncClient]):
    """One server, one tenant key, one `httpx.AsyncClient`; the constructor's arguments are
    `ClientBase`'s (`transport`: an `httpx.AsyncBaseTransport`), each method is `OPDClient`'s."""

    _http_class = httpx.AsyncClient

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncOPDClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    # -- plumbing -------------------------------------------------------------------------------

    async def _send(self, call: Call[operations.T]) -> operations.T:
        retrying = AsyncRetrying(sleep=asyncio.sleep, **operations.retry_policy(call.method, self.retries))

        async def attempt() -> httpx.Response:
            return await self._http.send(call.request(self._http))

        response = await retrying(attempt)
        return call.parse(operations.checked(response))

    async def _pages(self, call: Call[Page[Item]]) -> AsyncIterator[Item]:
        page_call: Call[Page[Item]] | None = call
        while page_call is not None:
            page = await self._send(page_call)
            for item in page.data:
                yield item
            page_call = operations.next_page(page_call, page)

    @staticmethod
    async def _check_stream(response: httpx.Response) -> None:
        if response.status_code >= 400:
            await response.aread()
            raise operations.api_error(response)

    # -- keys -----------------------------------------------------------------------------------

    async def create_key(self, tenant: str, admin_key: str) -> schemas.KeyPublic:
        return await self._send(operations.create_key(tenant, admin_key))

    async def list_keys(self, admin_key: str | None = None) -> list[schemas.KeyPublic]:
        return await self._send(operations.list_keys(admin_key))

    async def usage(self, admin_key: str | None = None) -> list[schemas.TenantUsage]:
        return await self._send(operations.usage(admin_key))

    async def revoke_key(self, key_id: str, admin_key: str) -> schemas.Deleted:
        return await self._send(operations.revoke_key(key_id, admin_key))

    # -- files ----------------------------------------------------------------------------------

    async def upload_file(
        self, path: str | Path, purpose: schemas.FilePurpose = "dataset"
    ) -> schemas.FilePublic:
        with ExitStack() as stack:
            # Zipping a folder (a model may be gigabytes) is blocking work: a worker thread does it.
            source = local_files.upload_source(path, purpose)
            filename, content = await asyncio.to_thread(stack.enter_context, source)
            return await self.upload_bytes(content, filename, purpose)

    async def upload_bytes(
        self, content: Any, filename: str, purpose: schemas.FilePurpose
    ) -> schemas.FilePublic:
        return await self._send(operations.upload_file(filename, content, purpose))

    async def list_files(self, purpose: schemas.FilePurpose | None = None) -> list[schemas.FilePublic]:
        return await self._send(operations.list_files(purpose))

    async def get_file(self, file_id: str) -> schemas.FilePublic:
        return await self._send(operations.get_file(file_id))

    async def delete_file(self, file_id: str) -> schemas.Deleted:
        return await self._send(operations.delete_file(file_id))

    # -- jobs -----------------------------------------------------------------------------------

    async def create_job(self, spec: dict[str, Any], dry_run: bool = False) -> schemas.JobPublic:
        return await self._send(operations.create_job(spec, dry_run))

    async def prepare_spec(self, spec: JobSpec) -> dict[str, Any]:
        """Uploads the spec's local datasets and workspace folders, all at once; returns it with
        file ids instead."""
        uploads = local_files.uploads(spec)
        uploaded = await asyncio.gather(*(self.upload_file(*upload) for upload in uploads))
        file_ids = {upload: file.id for upload, file in zip(uploads, uploaded, strict=True)}
        return local_files.spec_with_file_ids(spec, file_ids.__getitem__)

    async def submit(
        self, spec: JobSpec | dict[str, Any], base_dir: str | Path = ".", dry_run: bool = False
    ) -> schemas.JobPublic:
        return await self.create_job(await self.prepare_spec(local_files.parse_spec(spec, base_dir)), dry_run)

    async def run(self, **arguments: Unpack[RunArguments]) -> str:
        return (await self.submit(local_files.run_spec(arguments))).id

    async def list_jobs(
        self, status: str | None = None, limit: int = 20, after: str | None = None
    ) -> schemas.JobList:
        return await self._send(operations.list_jobs(status, limit, after))

    def iter_jobs(self, status: str | None = None, page_size: int = 100) -> AsyncIterator[schemas.JobPublic]:
        return self._pages(operations.list_jobs(status, page_size, None))

    async def get_job(self, job_id: str) -> schemas.JobPublic:
        return await self._send(operations.get_job(job_id))

    async def cancel_job(self, job_id: str) -> schemas.JobPublic:
        return await self._send(operations.job_action(job_id, "cancel"))

    async def pause_job(self, job_id: str) -> schemas.JobPublic:
        return await self._send(operations.job_action(job_id, "pause"))

    async def resume_job(self, job_id: str) -> schemas.JobPublic:
        return await self._send(operations.job_action(job_id, "resume"))

    async def delete_job(self, job_id: str) -> schemas.Deleted:
        return await self._send(operations.delete_job(job_id))

    async def events(self, job_id: str, after: int = 0, limit: int = 100) -> schemas.EventList:
        return await self._send(operations.events(job_id, after, limit))

    def iter_events(
        self, job_id: str, after: int = 0, page_size: int = 1000
    ) -> AsyncIterator[schemas.EventPublic]:
        return self._pages(operations.events(job_id, after, page_size))

    async def logs(self, job_id: str, after: int = 0) -> str:
        return await self._send(operations.logs(job_id, after))

    async def checkpoints(self, job_id: str) -> list[schemas.CheckpointPublic]:
        return await self._send(operations.checkpoints(job_id))

    async def download_checkpoint(
        self,
        job_id: str,
        checkpoint_id: str | None = None,
        target: str | Path | None = None,
        merged: bool = False,
    ) -> Path:
        if checkpoint_id is None:
            checkpoint_id = local_files.fine_tuned_model(await self.get_job(job_id))
        destination = local_files.download_target(job_id, checkpoint_id, target)
        call = operations.checkpoint_content(job_id, checkpoint_id, merged)
        with local_files.download_scratch(destination) as archive:
            async with self._http.stream(call.method, call.path, **call.options()) as response:
                await self._check_stream(response)
                # Chunks of a megabyte to the local disk: short writes, done on the event loop.
                with archive.open("wb") as sink:
                    async for chunk in response.aiter_bytes(local_files.DOWNLOAD_CHUNK):
                        sink.write(chunk)
            return await asyncio.to_thread(local_files.unpack_checkpoint, archive, destination)

    async def metrics(self, job_id: str) -> schemas.MetricsPublic:
        return await self._send(operations.metrics(job_id))

    async def trajectories(self, job_id: str, limit: int = 16) -> list[dict[str, Any]]:
        """Recent rollouts. Dicts: the API types a trajectory as a free-form object."""
        return await self._send(operations.trajectories(job_id, limit))

    async def validation_trajectories(
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
        return await self._send(operations.validation_trajectories(job_id, query, limit, offset))

    # -- webhooks -------------------------------------------------------------------------------

    async def create_webhook(
        self, url: str, events: list[str] | None = None, description: str = ""
    ) -> schemas.WebhookPublic:
        return await self._send(operations.create_webhook(url, events, description))

    async def list_webhooks(self) -> list[schemas.WebhookPublic]:
        return await self._send(operations.list_webhooks())

    async def get_webhook(self, webhook_id: str) -> schemas.WebhookPublic:
        return await self._send(operations.get_webhook(webhook_id))

    async def delete_webhook(self, webhook_id: str) -> schemas.Deleted:
        return await self._send(operations.delete_webhook(webhook_id))

    async def webhook_deliveries(
        self, webhook_id: str, limit: int = 20, after: str | None = None, job_id: str | None = None
    ) -> schemas.WebhookDeliveryList:
        return await self._send(operations.webhook_deliveries(webhook_id, limit, after, job_id))

    async def stream_events(
        self, job_id: str, after: int = 0, retries: int = 5
    ) -> AsyncIterator[schemas.EventPublic | StreamEnd]:
        """The job's events as they happen (SSE), then one `StreamEnd`; reconnects as `OPDClient`'s."""
        follower = operations.EventFollower(job_id, after, retries)
        async for attempt in AsyncRetrying(sleep=asyncio.sleep, **follower.retrying()):
            with attempt:
                call = follower.call()
                async with aconnect_sse(self._http, call.method, call.path, **call.options()) as source:
                    await self._check_stream(source.response)
                    async for sse in source.aiter_sse():
                        for item in follower.items(sse.event, sse.data):
                            yield item
                        if follower.ended:
                            return
                return  # the server closed the stream without an end event: nothing more to follow

    async def wait(
        self, job_id: str, poll_s: float = 2.0, timeout_s: float | None = None
    ) -> schemas.JobPublic:
        started = time.monotonic()
        while not operations.finished(
            job := await self.get_job(job_id), time.monotonic() - started, timeout_s
        ):
            await asyncio.sleep(poll_s)
        return job
