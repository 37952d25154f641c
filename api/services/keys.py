"""Tenants and their API keys: keys are random tokens stored as sha256 and compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time

from cachetools import TTLCache
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.errors import not_found
from api.models import ApiKey, Tenant
from api.services.ids import new_id
from opd_trainer.wire.schemas import KeyPublic

KEY_PREFIX = "opd-"


def hash_key(key: str) -> str:
    # A 256-bit random token needs no salt or slow hash: there is nothing to brute-force.
    return hashlib.sha256(key.encode()).hexdigest()


def _public(key: ApiKey, tenant: Tenant, secret: str | None = None) -> KeyPublic:
    return KeyPublic(id=key.id, tenant=tenant.name, prefix=key.prefix, created_at=key.created_at, key=secret)


def create_key(session: Session, tenant_name: str) -> KeyPublic:
    """A new key for `tenant_name`, creating the tenant on first use; the secret is returned once."""
    tenant = session.scalar(select(Tenant).where(Tenant.name == tenant_name))
    if tenant is None:
        tenant = Tenant(id=new_id("tenant"), name=tenant_name)
        session.add(tenant)
        session.flush()
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey(id=new_id("key"), tenant_id=tenant.id, key_hash=hash_key(secret), prefix=secret[:10])
    session.add(key)
    session.commit()
    return _public(key, tenant, secret)


def list_keys(session: Session, tenant_id: str | None) -> list[KeyPublic]:
    """Every live key (admin, `tenant_id` None) or the tenant's own."""
    query = select(ApiKey, Tenant).join(Tenant).where(ApiKey.revoked_at.is_(None)).order_by(ApiKey.created_at)
    if tenant_id is not None:
        query = query.where(ApiKey.tenant_id == tenant_id)
    return [_public(key, tenant) for key, tenant in session.execute(query).all()]


def revoke_key(session: Session, key_id: str) -> None:
    key = session.get(ApiKey, key_id)
    if key is None or key.revoked_at is not None:
        raise not_found("api key", key_id, "key_id")
    key.revoked_at = int(time.time())
    session.commit()


def authenticate(session: Session, presented: str) -> Tenant | None:
    """The tenant owning `presented`, or None."""
    digest = hash_key(presented)
    key = session.scalar(select(ApiKey).where(ApiKey.key_hash == digest, ApiKey.revoked_at.is_(None)))
    if key is None or not hmac.compare_digest(key.key_hash, digest):
        return None
    return session.get(Tenant, key.tenant_id)


class AuthCache:
    """Recently authenticated keys (sha256 → tenant), so status polls skip the key lookup.

    A `cachetools.TTLCache` (least recently used entries go first when full) behind a lock, as
    request handlers run in threads. Revocation through this server clears it at once; other
    replicas see a revocation within `ttl_s`.
    """

    def __init__(self, ttl_s: float = 5.0, max_entries: int = 10_000) -> None:
        self._entries: TTLCache[str, Tenant] = TTLCache(maxsize=max_entries, ttl=ttl_s)
        self._lock = threading.Lock()

    def get(self, digest: str) -> Tenant | None:
        with self._lock:
            return self._entries.get(digest)

    def put(self, digest: str, tenant: Tenant) -> None:
        with self._lock:
            self._entries[digest] = tenant

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def is_admin(presented: str, admin_key: str | None) -> bool:
    return admin_key is not None and hmac.compare_digest(presented.encode(), admin_key.encode())
