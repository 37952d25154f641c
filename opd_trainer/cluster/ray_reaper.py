"""Ends an embedded Ray's processes when the process that started it dies, however it dies.

`ray.init()` starts the GCS, the raylet and their agents as descendants of the calling process; when
that process is SIGKILLed (OOM killer, `kill -9`), some of them (`ray::DashboardAgent`,
`ray::RuntimeEnvAgent`) outlive it, re-parented to init, holding a few hundred MB. `start_reaper()`
launches this module as a small process in its own session (so a kill of the server's process group
does not take it along) that records the server's descendants every second and, once the server is
gone, terminates the last ones it saw (SIGTERM, SIGKILL after a grace period). Each is matched by its
creation time, so a process that reused a pid is never touched. Given the Ray session folder, it
then removes the runtime environments that session built (`remove_runtime_resources`, which
`ray_runtime.shutdown_ray` also calls). It imports no Ray: the reaper is a small process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

POLL_S = 1.0
GRACE_S = 5.0


def remove_runtime_resources(session_dir: Path | None) -> None:
    """Deletes what a finished Ray session built for runtime environments (`runtime_resources/`).

    A worker pool whose workspace has a requirements.txt gets a pip runtime environment; when Ray runs
    inside a virtualenv (a `make` install) Ray builds it by cloning that whole virtualenv, ~4 GB with
    torch and vLLM, and leaves it in the session folder after Ray stops. The session's logs stay.
    """
    if session_dir is not None:
        shutil.rmtree(session_dir / "runtime_resources", ignore_errors=True)


def start_reaper(pid: int | None = None, session_dir: Path | None = None) -> subprocess.Popen[bytes]:
    """Watches `pid` (default: this process) from a detached child."""
    arguments = [str(pid or os.getpid())] + ([str(session_dir)] if session_dir else [])
    return subprocess.Popen(
        [sys.executable, "-m", "opd_trainer.cluster.ray_reaper", *arguments],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def _descendants(parent: psutil.Process) -> dict[int, float]:
    found: dict[int, float] = {}
    try:
        for child in parent.children(recursive=True):
            try:
                found[child.pid] = child.create_time()
            except psutil.Error:
                continue
    except psutil.Error:
        pass
    return found


def _still_ours(pid: int, created: float) -> psutil.Process | None:
    try:
        process = psutil.Process(pid)
        if process.create_time() == created and process.status() != psutil.STATUS_ZOMBIE:
            return process
    except psutil.Error:
        pass
    return None


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def reap(pid: int) -> None:
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    me = os.getpid()
    seen: dict[int, float] = {}
    while _alive(parent):
        # Keep the latest view of live descendants: one that ended on its own drops out here.
        seen = {p: c for p, c in _descendants(parent).items() if p != me}
        time.sleep(POLL_S)
    left = [process for p, c in seen.items() if (process := _still_ours(p, c)) is not None]
    for process in left:
        try:
            process.terminate()
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(left, timeout=GRACE_S)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            continue


def main() -> None:
    reap(int(sys.argv[1]))
    if len(sys.argv) > 2:
        remove_runtime_resources(Path(sys.argv[2]))


if __name__ == "__main__":
    main()
