"""Runs the revisions on the connection `api.db.migrate` passes in (or, for developers' `alembic`
commands, on the server's configured database)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from api import models  # noqa: F401  (registers the tables on Base.metadata)
from api.db import Base, make_engine


def run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=True,  # SQLite alters a table by copying it; batch mode writes that for us
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = context.config.attributes.get("connection")
if connection is not None:
    run(connection)
else:
    from api.settings import Settings

    with make_engine(Settings().sqlalchemy_url).begin() as own_connection:
        run(own_connection)
