"""Webhook endpoints of a tenant: register (the secret is shown once), list, get, delete, and each
endpoint's delivery log. Deliveries themselves are `api.services.webhooks_delivery`'s."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, status

from api.deps import SessionDep, SettingsDep, TenantDep
from api.errors import TENANT, errors
from api.services import webhooks
from opd_trainer.wire.schemas import (
    Deleted,
    WebhookCreate,
    WebhookDeliveryList,
    WebhookList,
    WebhookPublic,
)

router = APIRouter(prefix="/v1/opd/webhooks", tags=["webhooks"])


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=WebhookPublic,
    responses=errors(400, *TENANT, 413, 422),
    description="Registers an endpoint for the tenant's job status changes. The URL must be https and "
    "resolve to public addresses only, unless the operator allows the receiver "
    "(OPD_WEBHOOK_ALLOWED_HOSTS); `secret` signs every delivery and is returned only here.",
)
def create_webhook(
    body: WebhookCreate, request: Request, session: SessionDep, settings: SettingsDep, tenant: TenantDep
) -> WebhookPublic:
    allowed = request.app.state.webhook_deliverer.allowed
    return webhooks.create(session, tenant.id, body, allowed, settings.webhook_max_endpoints_per_tenant)


@router.get("", response_model=WebhookList, responses=errors(*TENANT))
def list_webhooks(session: SessionDep, tenant: TenantDep) -> WebhookList:
    return webhooks.list_endpoints(session, tenant.id)


@router.get("/{webhook_id}", response_model=WebhookPublic, responses=errors(*TENANT, 404))
def get_webhook(webhook_id: str, session: SessionDep, tenant: TenantDep) -> WebhookPublic:
    return webhooks.get(session, tenant.id, webhook_id)


@router.delete("/{webhook_id}", response_model=Deleted, responses=errors(*TENANT, 404))
def delete_webhook(webhook_id: str, session: SessionDep, tenant: TenantDep) -> Deleted:
    webhooks.remove(session, tenant.id, webhook_id)
    return Deleted(id=webhook_id, object="opd.webhook")


@router.get(
    "/{webhook_id}/deliveries",
    response_model=WebhookDeliveryList,
    responses=errors(*TENANT, 404, 422),
    description="The endpoint's deliveries, newest first, each with every attempt (status code, error, "
    "duration).",
)
def list_webhook_deliveries(
    webhook_id: str,
    session: SessionDep,
    tenant: TenantDep,
    after: Annotated[
        str | None, Query(max_length=64, description="Last delivery id of the previous page.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    job_id: Annotated[str | None, Query(max_length=64, description="Only this job's deliveries.")] = None,
) -> WebhookDeliveryList:
    return webhooks.deliveries(session, tenant.id, webhook_id, after, limit, job_id)
