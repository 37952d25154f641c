"""Metering per tenant: the usage of a tenant's jobs (`jobs.usage`, reported by each job's driver,
`opd_trainer/driver/metering.py`) added up, with what its deleted jobs had used."""

from __future__ import annotations

from collections import defaultdict

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.models import Job, Tenant
from opd_trainer.wire.schemas import TenantUsage


def add_usage(total: dict[str, float], usage: dict[str, float]) -> dict[str, float]:
    """`total` + `usage`, key by key (a new dict)."""
    added = dict(total)
    for key, value in usage.items():
        if isinstance(value, int | float):
            added[key] = added.get(key, 0.0) + float(value)
    return added


def keep_usage_of_deleted(session: Session, job: Job) -> None:
    """A job about to be deleted: its usage stays in its tenant's total."""
    tenant = session.get(Tenant, job.tenant_id)
    if tenant is not None and job.usage:
        tenant.deleted_jobs_usage = add_usage(tenant.deleted_jobs_usage or {}, job.usage)


def tenant_usage(session: Session, tenant_id: str | None) -> list[TenantUsage]:
    """Each tenant's usage (one tenant's with `tenant_id`, else every tenant's, by name)."""
    tenants = select(Tenant).order_by(Tenant.name)
    jobs = select(Job.tenant_id, Job.usage)
    if tenant_id is not None:
        tenants = tenants.where(Tenant.id == tenant_id)
        jobs = jobs.where(Job.tenant_id == tenant_id)
    totals: dict[str, dict[str, float]] = defaultdict(dict)
    counts: dict[str, int] = defaultdict(int)
    for owner, usage in session.execute(jobs).all():
        totals[owner] = add_usage(totals[owner], usage or {})
        counts[owner] += 1
    return [
        TenantUsage(
            tenant_id=tenant.id,
            tenant=tenant.name,
            jobs=counts[tenant.id],
            usage=add_usage(totals[tenant.id], tenant.deleted_jobs_usage or {}),
        )
        for tenant in session.scalars(tenants).all()
    ]
