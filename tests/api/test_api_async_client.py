"""`AsyncOPDClient` against the real server (scheduler off: jobs stay queued, no Ray): uploads, a
submission with local files, reading, listing and paging jobs and events, the event stream until a
cancel ends the job, and errors; every answer is the API's own model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from apiserver import Server, Tenant, jsonl, record

from opd_trainer.client import AsyncOPDClient, OPDAPIError, StreamEnd
from opd_trainer.wire.schemas import (
    CheckpointPublic,
    Deleted,
    EventPublic,
    FilePublic,
    JobList,
    JobPublic,
    MetricsPublic,
)


async def _collect_stream(client: AsyncOPDClient, job_id: str) -> list[EventPublic | StreamEnd]:
    return [item async for item in client.stream_events(job_id)]


async def _session(server: Server, tenant: Tenant, tmp_path: Path, workspace_dir: Path) -> None:
    (tmp_path / "train.jsonl").write_bytes(jsonl([record("a"), record("b"), record("c")]))
    async with AsyncOPDClient(server.url, tenant.key) as client:
        dataset = await client.upload_file(tmp_path / "train.jsonl")
        assert isinstance(dataset, FilePublic) and dataset.purpose == "dataset" and dataset.samples == 3
        assert (await client.get_file(dataset.id)) == dataset
        assert dataset.id in [f.id for f in await client.list_files(purpose="dataset")]

        # Local files in the spec are uploaded (the workspace folder zipped), then the job submitted.
        spec = {
            **tenant.spec("train.jsonl", validation_datasets=[dataset.id]),
            "functions": [
                {
                    "name": "score",
                    "type": "reward",
                    "fcmodel": {"zipdir": str(workspace_dir), "classpath": "functions/reward.py:MyReward"},
                }
            ],
        }
        job = await client.submit(spec, base_dir=tmp_path)
        assert isinstance(job, JobPublic) and job.status == "queued" and job.job_name == "api-test"
        uploaded = job.spec["training_datasets"][0]
        assert uploaded.startswith("file-") and job.spec["validation_datasets"] == [dataset.id]
        workspace = await client.get_file(job.spec["functions"][0]["fcmodel"]["workspace"])
        assert workspace.purpose == "workspace" and workspace.filename == "workspace.zip"
        assert (await client.get_job(job.id)) == job

        # A second job by `run(...)`: the listing pages newest first, the iterator pages to the end.
        second = await client.run(
            job_name="second",
            model=tenant.models["student"],
            teacher_model=tenant.models["teacher"],
            training_datasets=[dataset.id],
        )
        page = await client.list_jobs(limit=1)
        assert isinstance(page, JobList) and [j.id for j in page.data] == [second] and page.has_more
        assert [j.id async for j in client.iter_jobs(page_size=1)] == [second, job.id]
        assert [j.id async for j in client.iter_jobs(status="queued")] == [second, job.id]

        assert (await client.pause_job(job.id)).status == "paused"
        assert (await client.resume_job(job.id)).status == "queued"
        events = (await client.events(job.id, limit=1000)).data
        assert all(isinstance(e, EventPublic) for e in events) and len(events) >= 4
        assert [e async for e in client.iter_events(job.id, page_size=2)] == events
        assert [e async for e in client.iter_events(job.id, after=events[1].id)] == events[2:]
        assert "pause requested: queued -> paused" in await client.logs(job.id)
        checkpoints: list[CheckpointPublic] = await client.checkpoints(job.id)
        assert checkpoints == []
        metrics = await client.metrics(job.id)
        assert isinstance(metrics, MetricsPublic) and metrics.data == [] and metrics.summary == {}
        assert await client.trajectories(job.id) == []

        # The stream follows the job until the cancel ends it, then hands over the finished job.
        following = asyncio.create_task(_collect_stream(client, job.id))
        await asyncio.sleep(0.5)  # connected and caught up
        assert (await client.cancel_job(job.id)).status == "cancelled"
        *streamed, end = await asyncio.wait_for(following, timeout=30)
        assert [e.id for e in streamed if isinstance(e, EventPublic)][: len(events)] == [e.id for e in events]
        assert streamed[-1].type == "status" and isinstance(end, StreamEnd)
        assert end.job is not None and end.job.status == "cancelled" and end.job.finished_at is not None
        assert (await client.wait(job.id, poll_s=0.1, timeout_s=10)).status == "cancelled"

        # Several requests at once on the one connection pool.
        fetched = await asyncio.gather(*(client.get_job(j) for j in (job.id, second, job.id)))
        assert [j.id for j in fetched] == [job.id, second, job.id]

        with pytest.raises(OPDAPIError) as missing:
            await client.get_job("opdjob-nope")
        assert (missing.value.status, missing.value.code, missing.value.field) == (404, "not_found", "job_id")
        with pytest.raises(OPDAPIError) as busy:  # the queued second job still uses the dataset
            await client.delete_file(dataset.id)
        assert (busy.value.status, busy.value.code) == (409, "file_in_use")

        assert (await client.delete_job(job.id)) == Deleted(id=job.id, object="opd.job")
        await client.cancel_job(second)
        assert (await client.delete_job(second)).deleted
        assert (await client.delete_file(uploaded)).id == uploaded


def test_async_client_uploads_submits_reads_follows_and_cancels(
    server: Server, tenant: Tenant, tmp_path: Path, workspace_dir: Path
) -> None:
    asyncio.run(_session(server, tenant, tmp_path, workspace_dir))
