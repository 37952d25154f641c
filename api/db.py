"""Database engine and sessions: SQLite under the data dir by default, PostgreSQL via `DATABASE_URL`.

Tables are created at start (`init_db`); there is no migration tool yet, so a schema change means a
new data dir or a hand-written `ALTER TABLE`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.pool import NullPool


class Base(DeclarativeBase):
    pass


def make_engine(url: str) -> Engine:
    # A request holds its connection while it waits for a thread-pool thread (FastAPI runs sync
    # handlers and dependencies there), so a pool smaller than the number of requests in flight can
    # leave every thread waiting for a connection that a thread-less request holds. SQLite
    # connections are a file open, so none is pooled; PostgreSQL gets a pool with ample overflow.
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True, pool_size=20, max_overflow=200, pool_timeout=60)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, poolclass=NullPool)

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(connection: Any, _record: Any) -> None:
        cursor = connection.cursor()
        # WAL lets readers (status polls) proceed while the scheduler writes events.
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return engine


def init_db(engine: Engine) -> None:
    from api import models  # noqa: F401  (registers the tables on Base.metadata)

    Base.metadata.create_all(engine)


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
