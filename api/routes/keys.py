"""API keys: the admin key creates and revokes tenant keys; a tenant may list its own."""

from __future__ import annotations

from fastapi import APIRouter, status

from api.deps import AdminDep, AuthCacheDep, CallerDep, SessionDep
from api.errors import errors
from api.services import keys
from opd_trainer.wire.schemas import Deleted, KeyCreate, KeyList, KeyPublic

router = APIRouter(prefix="/v1/keys", tags=["keys"])


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=KeyPublic,
    responses=errors(401, 403, 413, 422, 429),
)
def create_key(body: KeyCreate, session: SessionDep, _admin: AdminDep) -> KeyPublic:
    return keys.create_key(session, body.tenant)


@router.get("", response_model=KeyList, responses=errors(401, 429))
def list_keys(session: SessionDep, caller: CallerDep) -> KeyList:
    return KeyList(data=keys.list_keys(session, None if caller is None else caller.id))


@router.delete("/{key_id}", response_model=Deleted, responses=errors(401, 403, 404, 429))
def revoke_key(key_id: str, session: SessionDep, cache: AuthCacheDep, _admin: AdminDep) -> Deleted:
    keys.revoke_key(session, key_id)
    cache.clear()
    return Deleted(id=key_id, object="api_key")
