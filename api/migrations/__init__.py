"""Alembic migrations of the job server's database, run at server start (`api.db.migrate`).

One revision per schema change, in `versions/`; `env.py` runs them on the connection the server
passes in. To add one after changing `api/models.py`:

    .venv/bin/alembic -c api/migrations/alembic.ini revision --autogenerate -m "what changed"

then read the generated file (autogenerate misses renames), and let
`tests/api/test_api_migrations.py` check that the migrated schema equals the models.
"""
