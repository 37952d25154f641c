"""Alembic migrations: a database made by an earlier release is upgraded in place and served, and
the migrated schema is exactly what the models declare (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from apiserver import Server
from sqlalchemy import inspect

from api import models
from api.db import Base, Database, migrate
from api.services.keys import hash_key

SCHEMAS = Path(__file__).parent / "legacy_databases"
HEAD = "0006"
KEY = "opd-test-key-of-an-old-release-0123456789"


# What the 2026-12-01 release added to the 2026-11-30 schema, as its `create_all` wrote it.
SCHEDULER_LEASE_DDL = """CREATE TABLE scheduler_lease (
    name VARCHAR(32) NOT NULL,
    holder VARCHAR(200) NOT NULL,
    expires_at FLOAT NOT NULL,
    PRIMARY KEY (name)
);"""


def _old_database(path: Path, release: str) -> None:
    """A database as an earlier release left it: its schema, a tenant, a key, a finished job."""
    connection = sqlite3.connect(path)
    connection.executescript((SCHEMAS / "release-2026-11-30.sqlite.sql").read_text())
    if release == "2026-12-01":
        connection.executescript(SCHEDULER_LEASE_DDL)
    connection.execute("INSERT INTO tenants VALUES ('ten-1', 'acme', 1)")
    connection.execute(
        "INSERT INTO api_keys VALUES ('key-1', 'ten-1', ?, 'opd-test', 1, NULL)", (hash_key(KEY),)
    )
    spec = {"job_name": "old", "model": "/m", "teacher_model": "/t", "training_datasets": ["file-1"]}
    connection.execute(
        "INSERT INTO jobs VALUES (1, 'opdjob-old', 'ten-1', 'old', 'succeeded', ?, '[]', '/runs/old', "
        "1, 1.0, 2, 3, 4, 4, NULL, 128.0, '{\"reverse_kl\": 0.5}', NULL, 1, 0, 0, 7)",
        (json.dumps(spec),),
    )
    connection.executemany(
        "INSERT INTO job_events VALUES (?, 'opdjob-old', ?, 'status', ?, '{}')",
        [(1, 1.0, "queued"), (2, 2.0, "running"), (3, 3.0, "succeeded")],
    )
    connection.commit()
    connection.close()


@pytest.mark.parametrize("release", ["2026-11-30", "2026-12-01"])
def test_a_database_of_an_earlier_release_is_upgraded_in_place(tmp_path: Path, release: str) -> None:
    path = tmp_path / "opd.db"
    _old_database(path, release)
    database = Database(f"sqlite:///{path}")
    assert migrate(database.engine) == HEAD
    assert migrate(database.engine) == HEAD  # every start runs it; a second run changes nothing
    tables = set(inspect(database.engine).get_table_names())
    assert {"scheduler_lease", "alembic_version"} <= tables
    with database.session() as session:
        job = session.get(models.Job, 1)
        assert job is not None and job.status == "succeeded" and job.metrics == {"reverse_kl": 0.5}
        assert len(session.query(models.JobEvent).all()) == 3


def test_a_server_serves_the_jobs_of_an_upgraded_database(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    _old_database(data_dir / "opd.db", "2026-11-30")
    # No scheduler: this is about the database, and the server starts in a second without Ray.
    server = Server(data_dir, env={"OPD_MAX_CONCURRENT_JOBS": "0"}).start()
    try:
        headers = {"Authorization": f"Bearer {KEY}"}
        job = httpx.get(f"{server.url}/v1/opd/jobs/opdjob-old", headers=headers)
        assert job.status_code == 200, job.text
        assert job.json()["status"] == "succeeded" and job.json()["step"] == 4
        events = httpx.get(f"{server.url}/v1/opd/jobs/opdjob-old/events", headers=headers).json()
        assert [e["message"] for e in events["data"]] == ["queued", "running", "succeeded"]
    finally:
        server.stop()


def _schema_differences(url: str) -> list[object]:
    database = Database(url)
    assert migrate(database.engine) == HEAD
    with database.engine.connect() as connection:
        return list(compare_metadata(MigrationContext.configure(connection), Base.metadata))


def test_migrations_build_exactly_the_models_on_sqlite(tmp_path: Path) -> None:
    assert _schema_differences(f"sqlite:///{tmp_path / 'fresh.db'}") == []


def test_migrations_build_exactly_the_models_on_postgresql(postgres_databases: Callable[[], str]) -> None:
    assert _schema_differences(postgres_databases()) == []
