"""No server path in what a tenant reads of a job: its error, events, logs and checkpoints name the
job's files by the job's id, uploads by their file ids, and nothing else of the data directory or the
hub cache. A real SQLite file and run directory, the service functions the routes call; no server.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from api.db import Database, migrate
from api.models import Job, JobEvent, Tenant
from api.services import jobs
from api.services.server_paths import CHECKPOINT_MODEL, public_text
from opd_trainer.storage.checkpoints import CheckpointStore
from opd_trainer.wire.checkpoint import CheckpointState, CursorState

JOB_ID = "opdjob-0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Database]:
    db = Database(f"sqlite:///{tmp_path / 'opd.db'}")
    migrate(db.engine)
    yield db
    db.engine.dispose()


def test_paths_under_the_data_dir_and_hub_cache_become_ids_and_placeholders(
    tmp_path: Path, hub_cache: Path
) -> None:
    data = tmp_path / "data"
    run = data / "runs" / JOB_ID
    text = (
        f"saved {run}/checkpoints/step-000004; cannot read {data}/files/file-abc/train.jsonl: no; "
        f"workspace {data}/workspaces/file-ws does not exist, model ({data}/uploaded-models/file-m), "
        f"database '{data}/opd.db', {data}, snapshot {hub_cache}/models--org--x/snapshots/0123; "
        f"not ours: {data}2/x {tmp_path}/other"
    )
    assert public_text(text, data) == (
        f"saved {JOB_ID}/checkpoints/step-000004; cannot read file-abc/train.jsonl: no; "
        "workspace file-ws does not exist, model (file-m), "
        "database '<server path>', <server path>, snapshot <hub cache>/models--org--x/snapshots/0123; "
        f"not ours: {data}2/x {tmp_path}/other"
    )


def test_a_link_to_the_data_dir_is_named_by_either_path(tmp_path: Path, hub_cache: Path) -> None:
    real = tmp_path / "disk" / "data"
    real.mkdir(parents=True)
    link = tmp_path / "data"
    link.symlink_to(real, target_is_directory=True)
    assert public_text(f"{real}/runs/{JOB_ID}/x and {link}/opd.db", link) == f"{JOB_ID}/x and <server path>"


def test_a_jobs_error_events_logs_and_checkpoints_name_no_server_path(
    tmp_path: Path, database: Database, hub_cache: Path
) -> None:
    data = tmp_path / "data"
    run = data / "runs" / JOB_ID
    store = CheckpointStore(run / "checkpoints")
    staging = store.staging(4)
    (staging / "student").mkdir()
    state = CheckpointState(step=4, cursor=CursorState(epoch=0, position=4), total_steps=4)
    checkpoint = store.commit(staging, state)
    with database.session() as session:
        session.add(Tenant(id="tenant-1", name="t"))
        session.flush()
        session.add(
            Job(
                id=JOB_ID,
                tenant_id="tenant-1",
                job_name="j",
                status="failed",
                spec={},
                run_dir=str(run),
                error={
                    "code": "job_failed",
                    "message": f"cannot read {data}/files/file-abc/train.jsonl",
                    "param": "training_datasets.0",
                },
            )
        )
        events = [
            ("checkpoint", "saved step 4", {"step": 4, "path": str(checkpoint)}),
            ("error", f"tokenizer of {hub_cache}/models--o--m/snapshots/1: bad", {"in": [f"{data}/opd.db"]}),
        ]
        for kind, message, extra in events:
            session.add(JobEvent(job_id=JOB_ID, time=time.time(), type=kind, message=message, data=extra))
        session.commit()

        job = session.scalar(select(Job).where(Job.id == JOB_ID))
        assert job is not None
        answers = [
            jobs.public(job).model_dump_json(),
            jobs.list_events(session, "tenant-1", JOB_ID, 0, 100).model_dump_json(),
            jobs.logs(session, "tenant-1", JOB_ID, 0, 100),
            jobs.checkpoints(session, "tenant-1", JOB_ID).model_dump_json(),
            *(e.model_dump_json() for e in jobs.stream_snapshot(session, JOB_ID, 0)[0]),
        ]
        for answer in answers:
            assert str(tmp_path) not in answer, answer

        assert jobs.public(job).error.message == "cannot read file-abc/train.jsonl"  # type: ignore[union-attr]
        page = jobs.list_events(session, "tenant-1", JOB_ID, 0, 100).data
        assert page[0].data == {"step": 4, "path": f"{JOB_ID}/checkpoints/step-000004"}
        assert page[1].message == "tokenizer of <hub cache>/models--o--m/snapshots/1: bad"
        assert page[1].data == {"in": ["<server path>"]}
        [found] = jobs.checkpoints(session, "tenant-1", JOB_ID).data
        assert (found.path, found.student) == (
            f"{JOB_ID}/checkpoints/step-000004",
            f"{JOB_ID}/checkpoints/step-000004/student",
        )
        # The name the answer gives is the one a new job's `model` may use.
        named = CHECKPOINT_MODEL.fullmatch(found.student)
        assert named is not None and run / named["folder"] == checkpoint / "student"
