"""The sandbox a user processor runs in: a child process of its trusted pool worker, inside bubblewrap.

The pool worker (a trusted Ray actor) never imports user code. It starts the processor host
(`opd_trainer.workers.processor_host`) as a separate process and talks to it in JSON over a pipe
(`processor_channel`). That process, and everything it starts, gets:

- its own PID namespace (a fresh `/proc` that shows only the sandbox's processes: no other process's
  environment, root folder or file descriptors), IPC and UTS namespaces, and a new session;
- its own network namespace with only loopback (mode `gateway`, the default): the job's gateways are
  reachable through Unix sockets the trusted worker forwards, nothing else is (not Ray, not the
  cluster's ports, not the internet). `OPD_SANDBOX_NETWORK=host` shares the node's network instead,
  for processors that must call out (the operator's choice: the cluster's ports are then reachable);
- read-only: the system folders, the Python installation and this service's own packages; nothing
  else of the host (no data directory, database, model folders, Ray session directory, home folders);
- a private `/tmp` (workspace and scratch) and `/dev/shm`, tmpfs of the component's `disk_size`, and a
  minimal `/dev`;
- an environment built from an allowlist plus the component's validated `runtime.env`
  (`sandbox_environment`): no server secret, no Ray address or token, no loader variables;
- an unprivileged user (`OPD_SANDBOX_UID`, default 65534, when the worker is root) with no
  capabilities and `no_new_privs`;
- the whole process tree bounded by `memory_size` and a process count (`process_limits`: cgroup v2,
  else cgroup v1, else rlimits; the job's events say which), and killed with its worker
  (`--die-with-parent`: the PID namespace's init dies, and the kernel kills everything in it, a
  double fork included).

`OPD_PROCESSOR_SANDBOX` (read where the job driver runs): `auto` (default: bubblewrap when it works on
this node; where it does not, a job server refuses user code and `opd train` runs it unconfined with
a notice), `bwrap` (required everywhere), `none` (unconfined: a child process with the same clean
environment and limits but no namespaces; for a single-user box).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from opd_trainer.jobspec.job_spec import reserved_env_reason

SANDBOX_ENV = "OPD_PROCESSOR_SANDBOX"
BWRAP_ENV = "OPD_BWRAP"  # the bubblewrap binary, if not `bwrap` on PATH
NETWORK_ENV = "OPD_SANDBOX_NETWORK"
UID_ENV = "OPD_SANDBOX_UID"
DEFAULT_UID = 65534
# Set inside the sandbox, so a processor (and a test) can tell that it is confined, and how.
SANDBOXED_ENV = "OPD_SANDBOXED"
Mode = Literal["auto", "bwrap", "none"]
Network = Literal["gateway", "host"]
UserMode = Literal["same", "drop", "mapped"]
MASKED_FILES = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-", "/etc/sudoers")
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc", "/opt")
# Imported by the processor host; bound one by one, because an editable install's source checkout may
# hold data (model caches, a demo server's data dir) that user code must not read.
PACKAGES = ("opd_trainer", "rollout_workers", "reward_workers")
# Where the sandbox sees what its worker hands it: the workspace zip and the gateway sockets
# (read-only), and the installed requirements.
CONTROL_DIR = "/run/opd"
DEPS_DIR = "/run/opd-deps"
WORKSPACE_DIR = "/tmp/workspace"


class SandboxUnavailable(RuntimeError):
    """The sandbox is required here and bubblewrap cannot run."""


def configured_mode() -> Mode:
    value = os.environ.get(SANDBOX_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "bwrap", "none"):
        raise ValueError(f"{SANDBOX_ENV} must be auto, bwrap or none, got {value!r}")
    return value  # type: ignore[return-value]


def configured_network() -> Network:
    value = os.environ.get(NETWORK_ENV, "gateway").strip().lower() or "gateway"
    if value not in ("gateway", "host"):
        raise ValueError(f"{NETWORK_ENV} must be gateway or host, got {value!r}")
    return value  # type: ignore[return-value]


def configured_uid() -> int:
    value = os.environ.get(UID_ENV, "").strip()
    uid = int(value) if value else DEFAULT_UID
    if uid <= 0:
        raise ValueError(f"{UID_ENV} must be a positive user id, got {value!r}")
    return uid


@functools.cache
def user_mode() -> UserMode:
    """Who the sandbox runs as on this node.

    - `same`: the worker is not root; bubblewrap (unprivileged) runs as the worker's user, without
      capabilities (the Kubernetes layout: pods run as a non-root user).
    - `drop`: the worker is root; the launcher drops to `OPD_SANDBOX_UID` before bubblewrap starts.
    - `mapped`: the worker is root but that user cannot read the Python installation (a pyenv under
      `/root`, say); bubblewrap runs as root and maps the sandbox's user to it in a user namespace:
      no capability on the host, but files are checked as root's, so the sandbox masks the
      password databases. Installing Python world-readable gives `drop` instead.
    """
    if os.geteuid() != 0:
        return "same"
    uid = configured_uid()
    try:
        probe = subprocess.run(
            [sys.executable, "-I", "-c", "import encodings, ssl"],
            capture_output=True,
            timeout=60,
            user=uid,
            group=uid,
            extra_groups=[],
            cwd="/",
        )
    except (OSError, subprocess.TimeoutExpired):
        return "mapped"
    return "drop" if probe.returncode == 0 else "mapped"


def launcher_uid() -> int | None:
    """The user the limits launcher drops to before it starts the sandbox, if any."""
    return configured_uid() if user_mode() == "drop" else None


def bwrap_binary() -> str | None:
    return shutil.which(os.environ.get(BWRAP_ENV, "").strip() or "bwrap")


@functools.cache
def bwrap_problem() -> str | None:
    """None when bubblewrap can start a confined process here (as the sandbox user), else why not."""
    binary = bwrap_binary()
    if binary is None:
        return "bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    probe = [binary, "--unshare-all", "--die-with-parent", *user_options(), "--ro-bind", "/", "/"]
    uid = launcher_uid()
    try:
        result = subprocess.run(
            [*probe, "--proc", "/proc", "--dev", "/dev", "true"],
            capture_output=True,
            text=True,
            timeout=30,
            user=uid,
            group=uid,
            extra_groups=[] if uid is not None else None,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap could not run: {exc}"
    if result.returncode != 0:
        return f"bwrap cannot create its namespaces here: {result.stderr.strip()[:300]}"
    return None


def user_options() -> list[str]:
    """bwrap's user-namespace options for this node's `user_mode`."""
    if user_mode() != "mapped":
        return []
    uid = str(configured_uid())
    return ["--unshare-user", "--uid", uid, "--gid", uid]


def effective_mode(mode: Mode, *, server: bool) -> Literal["bwrap", "none"]:
    """What a job runs user code in. Raises `SandboxUnavailable` where the sandbox is required and
    cannot start: always for `bwrap`, and for `auto` on a job server (one with tenants)."""
    if mode == "none":
        return "none"
    problem = bwrap_problem()
    if problem is None:
        return "bwrap"
    if mode == "bwrap" or server:
        why = f"{SANDBOX_ENV}={mode}" if mode == "bwrap" else "a job server runs user code only confined"
        raise SandboxUnavailable(
            f"the processor sandbox cannot start on this node ({problem}); {why}. "
            f"The operator may set {SANDBOX_ENV}=none on a single-user server"
        )
    return "none"


def unconfined_reason() -> str:
    """Why user code would run unconfined here (for the job's warning event)."""
    if configured_mode() == "none":
        return f"{SANDBOX_ENV}=none"
    return bwrap_problem() or "bubblewrap works here"


def _package_dirs() -> list[Path]:
    found = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            found.append(Path(spec.origin).resolve().parent)
    return found


def package_roots() -> list[str]:
    """Where the sandboxed interpreter must look for this service's packages (its `PYTHONPATH`): the
    folders holding the package folders bound into the sandbox that lie outside the interpreter's own
    installation. A worker started with `PYTHONPATH` naming a source tree (a checkout run from source,
    `benchmarks/before_after.py`'s worktree of an earlier commit) imports the packages from there, and
    the sandbox binds those; without this, the sandboxed interpreter would look where its installation
    points (an editable install's checkout, not bound) and fail to start. Packages inside the
    installation (site-packages) are found without it."""
    installed = [Path(folder).resolve() for folder in python_dirs()]
    roots: list[str] = []
    for folder in _package_dirs():
        root = folder.parent
        if any(root.is_relative_to(prefix) for prefix in installed) or str(root) in roots:
            continue
        roots.append(str(root))
    return roots


def python_dirs() -> list[str]:
    """The interpreter and its libraries: the venv and the base installation it was made from."""
    found = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(Path(sys.executable).resolve().parents[1])}
    return sorted(found)


@dataclass(frozen=True)
class SandboxLayout:
    """What one sandbox is given from the host."""

    control_dir: Path  # bound read-only at CONTROL_DIR: the workspace zip and gateway sockets
    deps_dir: Path | None  # installed requirements, bound at DEPS_DIR (read-write while installing)
    scratch_mb: int  # the private /tmp and /dev/shm, each at most this size
    network: Network
    deps_writable: bool = False


def bwrap_command(layout: SandboxLayout, env: dict[str, str], argv: list[str]) -> list[str]:
    """The bwrap command line that runs `argv` confined (see the module docstring)."""
    size = ["--size", str(layout.scratch_mb * 1024 * 1024)]
    command = [
        bwrap_binary() or "bwrap",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        *user_options(),
    ]
    command += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if layout.network == "gateway":
        command += ["--unshare-net"]
    # The private /tmp first: binds below may lie under /tmp (a checkout or venv there) and must stay.
    command += [*size, "--tmpfs", "/tmp"]
    for folder in SYSTEM_DIRS:
        command += ["--ro-bind-try", folder, folder]
    for folder in python_dirs():
        command += ["--ro-bind-try", folder, folder]
    for folder in _package_dirs():
        command += ["--ro-bind", str(folder), str(folder)]
    if user_mode() == "mapped":  # files are checked as root's: hide what only root may read
        for secret in MASKED_FILES:
            if Path(secret).exists():
                command += ["--ro-bind", "/dev/null", secret]
    command += ["--proc", "/proc", "--dev", "/dev", *size, "--tmpfs", "/dev/shm"]
    command += ["--ro-bind", str(layout.control_dir), CONTROL_DIR]
    if layout.deps_dir is not None:
        bind = "--bind" if layout.deps_writable else "--ro-bind"
        command += [bind, str(layout.deps_dir), DEPS_DIR]
    command += ["--clearenv"]
    for name, value in env.items():
        command += ["--setenv", name, value]
    command += ["--chdir", "/tmp"]
    return [*command, "--", *argv]


def sandbox_environment(
    runtime_env: dict[str, str], *, mode: str, cpus: float, has_deps: bool
) -> dict[str, str]:
    """The processor's whole environment: an allowlist, then the component's `runtime.env`.

    Nothing is inherited from the worker: the server's secrets, Ray's address and token and the
    loader's variables never reach user code. `runtime.env` is validated by the job spec (it cannot
    name loader, interpreter or service variables); it is applied last, so it wins over the defaults
    it may override (`LANG`, thread counts).
    """
    threads = str(max(1, int(cpus)))
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONNOUSERSITE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "HF_HUB_OFFLINE": "1",
        SANDBOXED_ENV: mode,
    }
    if has_deps:
        env["OPD_SANDBOX_DEPS"] = DEPS_DIR
    # The spec refuses these names at submit; a spec that reached a worker by another path is held to
    # the same table here.
    env.update({name: value for name, value in runtime_env.items() if reserved_env_reason(name) is None})
    roots = package_roots()  # after runtime_env: reserved there, and only the service's own folders
    if roots:
        env["PYTHONPATH"] = os.pathsep.join(roots)
    return env
