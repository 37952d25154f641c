"""Database engine and sessions: SQLite under the data dir by default, PostgreSQL via `DATABASE_URL`.

The schema is Alembic's (`api/migrations`): `migrate` brings any database to the newest revision at
server start, including one created before migrations existed (made with `create_all`; such a
database is stamped with the revision its tables match first).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, inspect, make_url, text
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.pool import QueuePool


class Base(DeclarativeBase):
    pass


# libpq settings for PostgreSQL connections (a URL's own query parameters win): a connect gives up
# after 10 s, and a server gone silent without closing the connection (its node lost, a partition) is
# noticed within about a minute instead of the kernel's two hours, so a request or the scheduler's
# poll fails and is retried instead of hanging on it.
POSTGRES_CONNECT_ARGS: dict[str, int] = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}


def database_unavailable(exc: BaseException) -> bool:
    """Whether `exc` says the database could not be reached or dropped the connection (PostgreSQL
    restarted or failed over, the network between, SQLite's file locked), as opposed to a statement
    it refused: what failed may simply be tried again once the database answers.

    The pool forgets connections the error showed dead, and `pool_pre_ping` replaces the others when
    they are next taken, so the next try reconnects by itself."""
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def make_engine(url: str) -> Engine:
    # A request can hold its connection while it waits for a thread-pool thread (FastAPI runs sync
    # handlers and the session dependency's teardown there), so a pool that makes requests wait for
    # a connection can leave every thread waiting on a thread-less request: the overflow is
    # unbounded for SQLite (connections beyond the pool are closed when returned) and ample for
    # PostgreSQL. Pooling SQLite matters: opening a connection (and its PRAGMAs) and closing it
    # (the last close checkpoints the WAL) is ~30 % of a status read's CPU unpooled (py-spy).
    # 20 kept (64 measured worse: reads stalled more after a burst of submissions).
    if not url.startswith("sqlite"):
        parsed = make_url(url)
        connect_args: dict[str, int] = {}
        if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() in ("psycopg", "psycopg2"):
            connect_args = {k: v for k, v in POSTGRES_CONNECT_ARGS.items() if k not in parsed.query}
        # pool_pre_ping: a connection is tried (`SELECT 1`) before it is handed out, so one a database
        # restart closed is replaced instead of failing the request that takes it.
        return create_engine(
            url,
            pool_pre_ping=True,
            pool_size=20,
            max_overflow=200,
            pool_timeout=60,
            connect_args=connect_args,
        )
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": 30},
        poolclass=QueuePool,
        pool_size=20,
        max_overflow=-1,
    )

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(connection: Any, _record: Any) -> None:
        cursor = connection.cursor()
        # WAL lets readers (status polls) proceed while the scheduler writes events.
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return engine


MIGRATIONS = Path(__file__).parent / "migrations"
# Any constant: replicas starting together on PostgreSQL take turns to migrate.
MIGRATION_LOCK_KEY = 0x0BD_7A1E


def migrate(engine: Engine) -> str:
    """Upgrades the database to the newest revision; returns it. Safe to run on every start."""
    # Lazy: alembic loads only when migrations run.
    from alembic import command
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext

    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        config.attributes["connection"] = connection
        tables = set(inspect(connection).get_table_names())
        if "alembic_version" not in tables and "jobs" in tables:
            # Made by a release before migrations: its tables say which revision it is at.
            command.stamp(config, "0002" if "scheduler_lease" in tables else "0001")
        command.upgrade(config, "head")
        return str(MigrationContext.configure(connection).get_current_revision())


def ping(engine: Engine) -> None:
    with engine.connect() as connection:
        connection.execute(text("SELECT 1"))


class Database:
    """The engine plus a session factory; one per app."""

    def __init__(self, url: str) -> None:
        self.engine = make_engine(url)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self.sessions() as session:
            yield session
