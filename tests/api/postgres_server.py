"""A throwaway PostgreSQL server for the tests: Debian's `postgresql` binaries, a temporary data dir,
loopback only, trust authentication, fsync off; stopped and deleted afterwards.

As root, PostgreSQL refuses to run, so the server runs as the `postgres` user the Debian package
creates (`runuser`). `scripts/setup_venv.sh` installs the package on root + apt machines; elsewhere
set `OPD_TEST_DATABASE_URL` to an empty database of a server of your own.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from opd_trainer.cluster.ports import free_port

USER = "opd"


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL binaries here, or no unprivileged user to run them as."""


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(p.split("/")[4]))
    if not candidates:
        raise PostgresUnavailable(f"PostgreSQL's {name} not found (apt-get install postgresql)")
    return candidates[-1]


def _run_as() -> tuple[list[str], tuple[int, int] | None]:
    if os.geteuid() != 0:
        return [], None
    try:
        entry = pwd.getpwnam("postgres")
    except KeyError:
        raise PostgresUnavailable("running as root and no `postgres` user to run the server as") from None
    return ["runuser", "-u", "postgres", "--"], (entry.pw_uid, entry.pw_gid)


@contextmanager
def throwaway_postgres() -> Iterator[Callable[[], str]]:
    """Starts a server and yields a factory of SQLAlchemy URLs, each to a new empty database."""
    initdb, pg_ctl = _binary("initdb"), _binary("pg_ctl")
    prefix, owner = _run_as()
    # Not under pytest's tmp dir: that is private to root, and the server runs as `postgres`.
    root = Path(tempfile.mkdtemp(prefix="opd-pg-"))
    if owner is not None:
        os.chown(root, *owner)
    data, port = root / "data", free_port()

    def run(*command: str) -> None:
        done = subprocess.run([*prefix, *command], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} failed ({done.returncode}): {done.stderr or done.stdout}")

    run(initdb, "-D", str(data), "-U", USER, "-A", "trust", "-E", "UTF8", "--no-sync")
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=400"
    run(pg_ctl, "-D", str(data), "-l", str(root / "server.log"), "-w", "-t", "60", "-o", options, "start")
    try:
        import psycopg

        def new_database() -> str:
            name = f"opd_{uuid.uuid4().hex[:12]}"
            admin = f"host=127.0.0.1 port={port} user={USER} dbname=postgres"
            with psycopg.connect(admin, autocommit=True) as connection:
                connection.execute(f'CREATE DATABASE "{name}"')
            return f"postgresql+psycopg://{USER}@127.0.0.1:{port}/{name}"

        yield new_database
    finally:
        subprocess.run([*prefix, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
