"""An embedded Ray removes the runtime environments it built when its process ends, cleanly or by
SIGKILL (then the reaper does): a pip environment in a virtualenv is a ~4 GB clone of it."""

from __future__ import annotations

import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

SCRIPT = """
import os, signal, sys
import ray
from opd_trainer.cluster.ray_runtime import embedded_session_dir, init_ray

init_ray(reap_on_exit=True)

@ray.remote(num_cpus=0)
def where() -> str:
    return os.getcwd()

# A working_dir environment is unpacked under the session's runtime_resources/, as a pip one is built.
cwd = ray.get(where.options(runtime_env={"working_dir": "file://" + sys.argv[1]}).remote())
print(embedded_session_dir(), cwd, flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("ending", ["exit", "kill"])
def test_an_embedded_rays_runtime_environments_go_when_its_process_ends(tmp_path: Path, ending: str) -> None:
    workspace = tmp_path / "workspace.zip"
    with zipfile.ZipFile(workspace, "w") as archive:
        archive.writestr("workspace/marker.txt", "x")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(workspace), ending],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.stdout.strip(), done.stderr[-2000:]
    session_dir, actor_cwd = (Path(part) for part in done.stdout.split())
    built = session_dir / "runtime_resources"
    assert actor_cwd.is_relative_to(built), "the environment was not built in the session folder"
    deadline = time.monotonic() + 60  # after SIGKILL the reaper notices within a second, then ends Ray
    while built.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not built.exists()
    assert (session_dir / "logs").is_dir(), "the session's logs are kept"
