"""FastAPI dependencies as `Annotated` aliases: settings, a database session, the calling tenant or admin.

Dependencies that do no I/O are `async def`: FastAPI runs a plain `def` dependency in its thread
pool, where each is a thread hop; a status read makes two (the handler, and closing its session). The
tenant lookup leaves the event loop only when its key is not cached.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api.db import Database
from api.errors import APIError
from api.limits import StreamSlots
from api.models import Tenant
from api.services import keys
from api.services.scheduler import Scheduler
from api.settings import Settings

bearer = HTTPBearer(
    auto_error=False, description="`Authorization: Bearer <key>`; keys come from POST /v1/keys."
)


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_db(request: Request) -> Database:
    return request.app.state.db


async def get_session(db: Annotated[Database, Depends(get_db)]) -> AsyncIterator[Session]:
    """A session per request; it connects lazily (inside the handler's thread) and closes in a thread."""
    session = db.sessions()
    try:
        yield session
    finally:
        await run_in_threadpool(session.close)


async def get_scheduler(request: Request) -> Scheduler | None:
    return request.app.state.scheduler


async def get_stream_slots(request: Request) -> StreamSlots:
    return request.app.state.event_streams


SettingsDep = Annotated[Settings, Depends(get_settings)]
DatabaseDep = Annotated[Database, Depends(get_db)]
SessionDep = Annotated[Session, Depends(get_session)]
SchedulerDep = Annotated[Scheduler | None, Depends(get_scheduler)]
StreamSlotsDep = Annotated[StreamSlots, Depends(get_stream_slots)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def _presented(credentials: HTTPAuthorizationCredentials | None) -> str:
    if credentials is None or not credentials.credentials:
        raise APIError(401, "missing_api_key", "send `Authorization: Bearer <key>`", "Authorization")
    return credentials.credentials


async def get_auth_cache(request: Request) -> keys.AuthCache:
    return request.app.state.auth_cache


AuthCacheDep = Annotated[keys.AuthCache, Depends(get_auth_cache)]


def _authenticate(db: Database, presented: str) -> Tenant | None:
    with db.session() as session:
        return keys.authenticate(session, presented)


async def get_tenant(
    db: DatabaseDep, cache: AuthCacheDep, settings: SettingsDep, credentials: Credentials
) -> Tenant:
    """The caller's tenant: from the key cache, else a short session of its own in a thread."""
    presented = _presented(credentials)
    digest = keys.hash_key(presented)
    tenant = cache.get(digest)
    if tenant is None:
        tenant = await run_in_threadpool(_authenticate, db, presented)
        if tenant is not None:
            cache.put(digest, tenant)
    if tenant is None:
        admin = settings.admin_key.get_secret_value() if settings.admin_key else None
        if keys.is_admin(presented, admin):
            raise APIError(
                403, "admin_key", "the admin key manages keys only; use a tenant key", "Authorization"
            )
        raise APIError(401, "invalid_api_key", "unknown or revoked API key", "Authorization")
    return tenant


async def get_admin(settings: SettingsDep, credentials: Credentials) -> None:
    presented = _presented(credentials)
    if settings.admin_key is None:
        raise APIError(
            403, "admin_disabled", "no admin key is configured (set OPD_ADMIN_KEY)", "Authorization"
        )
    if not keys.is_admin(presented, settings.admin_key.get_secret_value()):
        raise APIError(401, "invalid_api_key", "this route needs the admin key", "Authorization")


def get_admin_or_tenant(
    session: SessionDep, settings: SettingsDep, credentials: Credentials
) -> Tenant | None:
    """None for the admin, else the tenant."""
    presented = _presented(credentials)
    admin = settings.admin_key.get_secret_value() if settings.admin_key else None
    if keys.is_admin(presented, admin):
        return None
    tenant = keys.authenticate(session, presented)
    if tenant is None:
        raise APIError(401, "invalid_api_key", "unknown or revoked API key", "Authorization")
    return tenant


TenantDep = Annotated[Tenant, Depends(get_tenant)]
AdminDep = Annotated[None, Depends(get_admin)]
CallerDep = Annotated[Tenant | None, Depends(get_admin_or_tenant)]
