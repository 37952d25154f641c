"""Confines the Ray workers that run user processors with bubblewrap (`bwrap`, Debian's `bubblewrap`).

A processor worker sees, read-only, the system (`/usr`, `/etc`, ...), the Python installation and
this service's own packages; read-write, a private `/tmp` (its workspace and scratch, a tmpfs of the
component's `runtime.disk_size`), Ray's session
directory and `/dev/shm` (both Ray needs to run the worker at all). It does not see the server's data
directory (other tenants' uploads, run directories, checkpoints), the SQLite database, the model
folders, home directories or the source checkout beyond the packages. Secrets are not in its
environment either (`api.settings.withhold_secrets_from_children`).

What it does not stop, and needs the Kubernetes layout instead (the chart's user-code worker group,
which mounts no data volume: `OPD_USER_CODE_RESOURCE` in `worker_pool`): network access (the worker
must reach Ray's GCS and the job's gateway over TCP), other processes of the same user (no PID
namespace: Ray watches its workers by PID), reading Ray's session directory (other workers' logs) and
calling Ray itself (a worker holds the cluster's token, so it can submit tasks or look up named actors
on the cluster it belongs to). CPU time is bounded by the call timeout and memory by `memory_size`,
both enforced by the pool.

How it is wired: Ray launches a worker as `<py_executable> default_worker.py ARGS`; the pool sets the
component's `runtime_env.py_executable` to `python -m opd_trainer.workers.sandbox`, whose `main` execs
`bwrap ... python default_worker.py ARGS`. With a `requirements.txt`, Ray's pip environment activates
its virtualenv first, and the wrapper starts that virtualenv's Python inside the sandbox.

`OPD_PROCESSOR_SANDBOX` (read where the job driver runs): `auto` (default: bubblewrap when it works on
this node, else unconfined with a warning), `bwrap` (required: a job fails to start without it),
`none` (unconfined).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Literal

SANDBOX_ENV = "OPD_PROCESSOR_SANDBOX"
# Set inside the sandbox, so a worker can tell (and the pool can check) that it is confined.
SANDBOXED_ENV = "OPD_SANDBOXED"
SCRATCH_OPTION = "--scratch-mb"
Mode = Literal["auto", "bwrap", "none"]
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc", "/opt")
# Imported by processor workers; bound one by one, because an editable install's source checkout may
# hold data (model caches, a demo server's data dir) that user code must not read.
PACKAGES = ("opd_trainer", "rollout_workers", "reward_workers")


class SandboxUnavailable(RuntimeError):
    """`OPD_PROCESSOR_SANDBOX=bwrap` on a node where bubblewrap cannot run."""


def configured_mode() -> Mode:
    value = os.environ.get(SANDBOX_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "bwrap", "none"):
        raise ValueError(f"{SANDBOX_ENV} must be auto, bwrap or none, got {value!r}")
    return value  # type: ignore[return-value]


@functools.cache
def bwrap_problem() -> str | None:
    """None when bubblewrap can start a confined process here, else why not (checked once)."""
    binary = shutil.which("bwrap")
    if binary is None:
        return "bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    try:
        result = subprocess.run(
            [binary, "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "true"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap could not run: {exc}"
    if result.returncode != 0:
        return f"bwrap cannot create its namespaces here: {result.stderr.strip()[:300]}"
    return None


def worker_py_executable(scratch_mb: int | None = None, mode: Mode | None = None) -> str | None:
    """The `runtime_env.py_executable` that confines a processor worker, or None to run it unconfined.

    `scratch_mb` caps the private /tmp (workspace + scratch; the component's `runtime.disk_size`).
    Raises `SandboxUnavailable` when the mode is `bwrap` and bubblewrap cannot run here.
    """
    mode = mode or configured_mode()
    reason = unconfined_reason(mode)
    if reason is not None:
        if mode == "bwrap":
            raise SandboxUnavailable(f"{SANDBOX_ENV}=bwrap but {reason}")
        return None
    scratch = f" {SCRATCH_OPTION} {scratch_mb}" if scratch_mb else ""
    return f"{sys.executable} -m opd_trainer.workers.sandbox{scratch}"


def _package_dirs() -> list[Path]:
    found = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            found.append(Path(spec.origin).resolve().parent)
    return found


def _option(args: list[str], name: str) -> str | None:
    prefix = f"--{name}="
    return next((a[len(prefix) :] for a in args if a.startswith(prefix)), None)


def unconfined_reason(mode: Mode | None = None) -> str | None:
    """None when processor workers will be confined, else why not (for the job's warning event)."""
    mode = mode or configured_mode()
    if mode == "none":
        return f"{SANDBOX_ENV}=none"
    return bwrap_problem()


def bwrap_command(worker_args: list[str], python: str, scratch_mb: int | None = None) -> list[str]:
    """The bwrap command line that runs `python worker_args...` confined (see the module docstring)."""
    # The private /tmp first: binds below may lie under /tmp (a checkout or venv there) and must stay.
    size = ["--size", str(scratch_mb * 1024 * 1024)] if scratch_mb else []
    command = ["bwrap", "--die-with-parent", *size, "--tmpfs", "/tmp"]
    for folder in SYSTEM_DIRS:
        command += ["--ro-bind-try", folder, folder]
    # The interpreter and its libraries: the venv and the base installation it was made from.
    interpreters = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(Path(python).resolve().parents[1])}
    for folder in sorted(interpreters):
        command += ["--ro-bind-try", folder, folder]
    for folder in _package_dirs():
        command += ["--ro-bind", str(folder), str(folder)]
    command += ["--proc", "/proc", "--dev-bind", "/dev", "/dev"]
    # Ray's sockets, logs and runtime environments (pip virtualenvs live there too), read-write.
    ray_temp = _option(worker_args, "temp-dir") or "/tmp/ray"
    session = _option(worker_args, "session-dir")
    for folder in (ray_temp, session, "/dev/shm"):
        if folder:
            command += ["--bind-try", folder, folder]
    # The worker's own credential for the Ray cluster (token authentication), read-only.
    token = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if token.is_file():
        command += ["--ro-bind", str(token), str(token), "--setenv", "RAY_AUTH_TOKEN_PATH", str(token)]
    command += ["--setenv", "HOME", "/tmp", "--setenv", SANDBOXED_ENV, "bwrap", "--chdir", "/tmp"]
    return [*command, python, *worker_args]


def main() -> None:
    """`python -m opd_trainer.workers.sandbox [--scratch-mb N] default_worker.py ARGS`: exec it in bwrap."""
    args = sys.argv[1:]
    scratch_mb = None
    if args[:1] == [SCRATCH_OPTION]:
        scratch_mb, args = int(args[1]), args[2:]
    virtualenv = os.environ.get("VIRTUAL_ENV")
    python = str(Path(virtualenv) / "bin" / "python") if virtualenv else sys.executable
    command = bwrap_command(args, python, scratch_mb)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
