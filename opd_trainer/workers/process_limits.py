"""Bounds on a sandbox's whole process tree: memory and process count, by cgroup or by rlimits.

`ProcessLimits.create` picks the strongest mechanism this node allows, in order:

- cgroup v2 (`/sys/fs/cgroup` is the unified hierarchy and the worker may create a child group with
  the `memory` and `pids` controllers): `memory.max`, `memory.swap.max = 0`, `pids.max`; the kernel
  counts every process of the tree, tmpfs pages (`/tmp`, `/dev/shm`) included, and kills inside the
  group when it is exceeded.
- cgroup v1 (writable `memory` and `pids` hierarchies, as Docker-style hosts mount them): the same
  limits through `memory.limit_in_bytes` and `pids.max`.
- rlimits: `RLIMIT_AS` per process (address space, an over-estimate of memory) and `RLIMIT_NPROC`
  (processes of the sandbox's user namespace); weaker, and the job's events say so.

The limits are entered by the launcher (`python -I -m opd_trainer.workers.process_limits ... -- CMD`):
a small trusted program that joins the groups, sets rlimits, drops to the sandbox user and execs CMD
(bwrap), so nothing of the user's runs before its bounds are in place. It imports only the standard
library and runs isolated (`-I`), so no environment variable of the caller changes what it does.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CGROUP_ROOT = Path("/sys/fs/cgroup")
GROUP_PREFIX = "opd-sandbox-"
MB = 1024 * 1024
OPEN_FILES = 4096
MAX_PID = 4194304  # the kernel's largest pid_max


@dataclass
class ProcessLimits:
    """The bounds of one sandbox; `describe()` says which mechanism holds them."""

    memory_mb: int
    max_processes: int
    mechanism: str  # "cgroup v2", "cgroup v1" or "rlimits"
    groups: list[Path] = field(default_factory=list)  # cgroup folders to join (and remove after)

    @classmethod
    def create(cls, memory_mb: int, max_processes: int) -> ProcessLimits:
        name = f"{GROUP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        for make in (_cgroup_v2, _cgroup_v1):
            made = make(name, memory_mb, max_processes)
            if made is not None:
                return made
        return cls(memory_mb, max_processes, "rlimits")

    def describe(self) -> str:
        return f"{self.mechanism} (memory {self.memory_mb} MB, {self.max_processes} processes)"

    def launcher_argv(self, uid: int | None) -> list[str]:
        """The launcher's command line, to be followed by `--` and the command it execs."""
        argv = [sys.executable, "-I", "-m", "opd_trainer.workers.process_limits"]
        argv += ["--memory-mb", str(self.memory_mb), "--max-processes", str(self.max_processes)]
        argv += ["--rlimits" if self.mechanism == "rlimits" else "--no-rlimits"]
        for group in self.groups:
            argv += ["--cgroup", str(group)]
        if uid is not None:
            argv += ["--uid", str(uid)]
        return argv

    def memory_used_mb(self) -> float | None:
        """What the kernel charges the sandbox's group (pages shared between its processes counted
        once, tmpfs included); None without a cgroup."""
        for group in self.groups:
            for name in ("memory.current", "memory.usage_in_bytes"):  # v2, v1
                with contextlib.suppress(OSError, ValueError):
                    return int((group / name).read_text().strip()) / MB
        return None

    def out_of_memory(self) -> bool:
        """Whether the kernel killed a process of this sandbox for memory (cgroups only)."""
        for group in self.groups:
            for name in ("memory.events", "memory.oom_control"):  # v2, v1
                counts = _counts(group / name)
                if counts.get("oom_kill", 0) > 0:
                    return True
        return False

    def kill_all(self) -> None:
        """Kills every process still in the groups (a process that left the PID namespace cannot exist,
        but one the init did not reap may still be counted), then removes the groups."""
        for group in self.groups:
            kill_file = group / "cgroup.kill"
            try:
                if kill_file.exists():
                    kill_file.write_text("1")
                else:
                    for pid in (group / "cgroup.procs").read_text().split():
                        os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
        for group in self.groups:
            # Still emptying: a group left behind holds no process and no memory.
            with contextlib.suppress(OSError):
                group.rmdir()


def owner_alive(name: str) -> bool:
    """Whether the worker that made `opd-sandbox-<pid>-...` (a group or a control folder) still runs.
    A worker killed by Ray (SIGKILL) cannot remove what it made; the next one on the node does."""
    field = name.split("-")[2] if name.count("-") >= 3 else ""
    if not (field.isdigit() and 0 < int(field) <= MAX_PID):
        return True  # not named by a worker: not ours to judge
    try:
        os.kill(int(field), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_groups(parents: list[Path]) -> None:
    """Removes sandbox groups whose worker is gone (empty by then: their processes died with it)."""
    for parent in parents:
        for group in parent.glob(f"{GROUP_PREFIX}*"):
            if not owner_alive(group.name):
                with contextlib.suppress(OSError):
                    group.rmdir()


def _counts(path: Path) -> dict[str, int]:
    """A cgroup `key value` file as numbers; {} when it does not exist."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    pairs = (line.split() for line in lines)
    return {words[0]: int(words[1]) for words in pairs if len(words) == 2 and words[1].isdigit()}


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
    except OSError:
        return False
    return True


def _cgroup_v2(name: str, memory_mb: int, max_processes: int) -> ProcessLimits | None:
    if not (CGROUP_ROOT / "cgroup.controllers").exists():
        return None
    own = _own_cgroup_v2()
    if own is None:
        return None
    parent = CGROUP_ROOT / own.lstrip("/")
    enabled = (parent / "cgroup.subtree_control").read_text().split() if parent.exists() else []
    if not {"memory", "pids"} <= set(enabled):
        return None  # enabling controllers here would move the worker itself: not ours to do
    remove_stale_groups([parent])
    group = parent / name
    try:
        group.mkdir()
    except OSError:
        return None
    ok = _write(group / "memory.max", str(memory_mb * MB)) and _write(group / "pids.max", str(max_processes))
    _write(group / "memory.swap.max", "0")
    if not ok:
        group.rmdir()
        return None
    return ProcessLimits(memory_mb, max_processes, "cgroup v2", [group])


def _own_cgroup_v2() -> str | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def _cgroup_v1(name: str, memory_mb: int, max_processes: int) -> ProcessLimits | None:
    memory_root, pids_root = CGROUP_ROOT / "memory", CGROUP_ROOT / "pids"
    if not ((memory_root / "memory.limit_in_bytes").exists() and (pids_root / "cgroup.procs").exists()):
        return None
    remove_stale_groups([memory_root, pids_root])
    made: list[Path] = []
    try:
        for root in (memory_root, pids_root):
            (root / name).mkdir()
            made.append(root / name)
    except OSError:
        for group in made:
            group.rmdir()
        return None
    memory, pids = made
    ok = _write(memory / "memory.limit_in_bytes", str(memory_mb * MB))
    ok = ok and _write(pids / "pids.max", str(max_processes))
    # Swap counts against the same limit where the kernel accounts it (memsw); absent otherwise.
    if (memory / "memory.memsw.limit_in_bytes").exists():
        _write(memory / "memory.memsw.limit_in_bytes", str(memory_mb * MB))
    if not ok:
        for group in made:
            group.rmdir()
        return None
    return ProcessLimits(memory_mb, max_processes, "cgroup v1", made)


def _parse(argv: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    if "--" not in argv:
        raise SystemExit("usage: process_limits [options] -- COMMAND ...")
    split = argv.index("--")
    options: dict[str, list[str]] = {}
    words = argv[:split]
    index = 0
    while index < len(words):
        name = words[index]
        if name in ("--rlimits", "--no-rlimits"):
            options[name] = []
            index += 1
        else:
            options.setdefault(name, []).append(words[index + 1])
            index += 2
    return options, argv[split + 1 :]


def main(argv: list[str] | None = None) -> None:
    """Joins the groups, sets the rlimits, drops to the sandbox user and execs the command."""
    options, command = _parse(sys.argv[1:] if argv is None else argv)
    for group in options.get("--cgroup", []):
        Path(group, "cgroup.procs").write_text(str(os.getpid()))
    memory_mb = int(options["--memory-mb"][0])
    max_processes = int(options["--max-processes"][0])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))
    if "--rlimits" in options:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb * MB, memory_mb * MB))
        resource.setrlimit(resource.RLIMIT_NPROC, (max_processes, max_processes))
    import ctypes  # before dropping the user: the Python installation may be root's alone

    if "--uid" in options:
        uid = int(options["--uid"][0])
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    _die_with_parent(ctypes)  # after setuid, which clears it
    os.execvp(command[0], command)


def _die_with_parent(ctypes: Any) -> None:
    """The command gets SIGKILL when the worker that started it dies (kept across exec)."""
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


if __name__ == "__main__":
    main()
