"""The server's secrets stay in the server: nothing it starts (embedded Ray, job drivers, the workers
that run user processors) has the admin key or the database URL in its environment.

Real `opd serve` with the scheduler on (so Ray starts), then every process of its session is read
from /proc. Ray starts its workers from the raylet's environment, so a secret missing there is missing
in every worker, user processors included.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from apiserver import ADMIN_KEY, Server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _environ(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        name = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # exited meanwhile
        return None
    entries = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {"_cmdline": name, **{key: value for key, _, value in entries}}


def _session_processes(session_id: int) -> dict[int, dict[str, str]]:
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) != session_id:
                    continue
            except OSError:
                continue
            environ = _environ(int(entry.name))
            if environ is not None:
                found[int(entry.name)] = environ
    return found


def test_no_process_the_server_starts_inherits_its_secrets(tmp_path: Path) -> None:
    database_url = f"sqlite:///{tmp_path / 'secret-name.db'}"
    server = Server(
        tmp_path / "data", env={"OPD_MAX_CONCURRENT_JOBS": "1", "OPD_DATABASE_URL": database_url}
    ).start(ready_timeout=180, wait_ready=True)  # ready = Ray started
    try:
        assert server.process is not None
        processes = _session_processes(server.process.pid)
        started = {pid: env for pid, env in processes.items() if pid != server.process.pid}
        commands = " | ".join(env["_cmdline"][:60] for env in started.values())
        assert any("raylet" in env["_cmdline"] for env in started.values()), commands
        for pid, env in started.items():
            leaked = [name for name in ("OPD_ADMIN_KEY", "OPD_DATABASE_URL") if name in env]
            assert not leaked, f"{env['_cmdline'][:80]} (pid {pid}) inherited {leaked}"
            assert ADMIN_KEY not in env.values() and database_url not in env.values()
    finally:
        server.stop()
