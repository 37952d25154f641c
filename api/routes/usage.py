"""Metering: what tenants' jobs used (`GET /v1/usage`); a tenant sees its own, the admin every tenant's."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import CallerDep, SessionDep
from api.errors import errors
from api.services.usage import tenant_usage
from opd_trainer.wire.schemas import UsageList

router = APIRouter(prefix="/v1/usage", tags=["usage"])


@router.get("", response_model=UsageList, responses=errors(401, 429))
def get_usage(session: SessionDep, caller: CallerDep) -> UsageList:
    return UsageList(data=tenant_usage(session, None if caller is None else caller.id))
