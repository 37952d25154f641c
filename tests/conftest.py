"""Session fixtures shared by every test folder: the tiny models (built once, cached on disk) and one
training `opd serve` for the tests that submit jobs over HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from opd_trainer.demo.tiny_models import TinyModels

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_models() -> TinyModels:
    """`make test` builds them first (`opd make-tiny-models`), so this is normally a cache hit.

    Imported here, not at module level: unit tests must not pay for (or be affected by) torch and
    transformers being imported at collection time.
    """
    from opd_trainer.demo.tiny_models import build_tiny_models

    return build_tiny_models(Path(os.environ.get("OPD_TINY_MODELS_DIR", REPO / ".cache" / "tiny-models")))


@pytest.fixture(scope="session")
def _training_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    sys.path.insert(0, str(REPO / "tests" / "api"))
    from apiserver import TINY_MODELS_DIR, Server

    root = tmp_path_factory.mktemp("training-server")
    (root / "models").mkdir()
    # Teacher engines shared between jobs (engine/shared_engines.py): the jobs here run one after
    # another, so a job whose teacher matches an earlier one's scores on its engines (the server path
    # of sharing, tested by every job on this server; the per-job default is what the integration
    # tests' drivers run).
    env = {"OPD_MAX_CONCURRENT_JOBS": "1", "OPD_SHARED_TEACHER_IDLE_S": "600"}
    server = Server(root / "data", env=env, model_dirs=[TINY_MODELS_DIR, root / "models"])
    yield server
    server.stop()


@pytest.fixture
def training_server(_training_server: Any) -> Any:
    """One real `opd serve` (SQLite file, embedded Ray, scheduler on, one job at a time, teacher engines
    shared between jobs) shared by the tests that train over HTTP and need nothing else of a server: its
    start-up (a Ray, ~20 s on 2 busy cores) is paid once, not once per test. Jobs may take models from
    the tiny models and from `training_server.model_dirs[-1]`, where a test may make model folders (with
    names of its own).

    Started on first use and again after a test that killed it without starting it again; a test that
    kills it (SIGKILL, then `start` on the same data dir) leaves it running for the next.
    """
    server = _training_server
    if server.process is None or server.process.poll() is not None:
        server.start(ready_timeout=300, wait_ready=True)
    return server


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Any]:
    """`tmpfs(size_bytes)`: a real small file system mounted under tmp_path (a full disk on demand),
    unmounted afterwards; skipped where mounting is not permitted (root only)."""
    mounts: list[Path] = []

    def mount(size_bytes: int) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        path = tmp_path / f"disk{len(mounts)}"
        path.mkdir()
        command = ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"mount -t tmpfs is not permitted here: {done.stderr.strip()}")
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
