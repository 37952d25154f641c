"""Fixtures of the API tests: one real `opd serve` (SQLite file in tmp, scheduler off), tenants, files.

The shared server runs with `OPD_MAX_CONCURRENT_JOBS=0`, so jobs stay queued and no Ray starts; the
tests that train (`-m integration`) start their own servers with the scheduler on.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from apiserver import WORKSPACE, Server, Tenant, make_shaped_model, make_tenant, make_tokenizer, zip_bytes
from postgres_server import PostgresUnavailable, throwaway_postgres

if TYPE_CHECKING:
    from opd_trainer.demo.tiny_models import TinyModels

# Small limits, so the oversized-upload and body cases need only kilobytes.
SERVER_ENV = {
    "OPD_MAX_CONCURRENT_JOBS": "0",
    "OPD_MAX_UPLOAD_BYTES": str(256 * 1024),
    "OPD_MAX_BODY_BYTES": str(64 * 1024),
    "OPD_TENANT_MAX_ACTIVE_JOBS": "4",
}


@pytest.fixture
def trained_models(request: pytest.FixtureRequest) -> TinyModels:
    """`tests/conftest.py`'s session fixture `tiny_models`; skips where it is not there yet."""
    try:
        return request.getfixturevalue("tiny_models")
    except pytest.FixtureLookupError:
        pytest.skip("needs the tiny_models fixture of tests/conftest.py")


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared server's approved model directory (OPD_MODEL_DIRS)."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared server's Hugging Face hub cache (HF_HUB_CACHE; offline: nothing is downloaded)."""
    return tmp_path_factory.mktemp("hub")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, models_root: Path, hub_cache: Path) -> Iterator[Server]:
    data_dir = tmp_path_factory.mktemp("api") / "data"
    env = {**SERVER_ENV, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    server = Server(data_dir, env=env, model_dirs=[models_root]).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def models(models_root: Path) -> dict[str, str]:
    root = models_root
    return {
        "student": str(make_tokenizer(root / "student")),
        "teacher": str(make_tokenizer(root / "teacher")),
        "other": str(make_tokenizer(root / "other", "completely different words here")),
        "shaped": str(make_shaped_model(root / "shaped")),
    }


@pytest.fixture
def tenant(server: Server, models: dict[str, str]) -> Iterator[Tenant]:
    yield from make_tenant(server, models)


@pytest.fixture
def other_tenant(server: Server, models: dict[str, str]) -> Iterator[Tenant]:
    yield from make_tenant(server, models)


@pytest.fixture
def workspace_zip() -> bytes:
    return zip_bytes(WORKSPACE)


@pytest.fixture
def workspace_dir(tmp_path: Path) -> Path:
    root = tmp_path / "workspace"
    for name, content in WORKSPACE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(content)
    return root


@pytest.fixture(scope="session")
def postgres_databases() -> Iterator[Callable[[], str]]:
    """A factory of empty PostgreSQL databases (SQLAlchemy URLs) on a throwaway server, or on
    `OPD_TEST_DATABASE_URL`'s server when it is set (then every call returns that one database)."""
    given = os.environ.get("OPD_TEST_DATABASE_URL", "")
    if given:
        yield lambda: given
        return
    try:
        with throwaway_postgres() as new_database:
            yield new_database
    except PostgresUnavailable as exc:
        pytest.skip(str(exc))
