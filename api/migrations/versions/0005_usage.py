"""Metering: what each job used (`jobs.usage`) and what a tenant's deleted jobs had used
(`tenants.deleted_jobs_usage`), so a tenant's total survives deleting a job.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Server defaults fill the rows of an earlier release; the models' own defaults fill new ones.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("usage", sa.JSON(), nullable=False, server_default="{}"))
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("deleted_jobs_usage", sa.JSON(), nullable=False, server_default="{}"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("usage")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("deleted_jobs_usage")
