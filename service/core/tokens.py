"""Admin API tokens and one-time dashboard login links.

Both are 256-bit random strings shown once and stored as SHA-256 (see
`models.token`).  A login link expires (15 minutes by default) and works once:
consuming it is a single conditional UPDATE, so two racing requests cannot
both log in with it.
"""
from __future__ import annotations

import hashlib
import logging
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from models import ApiToken, LoginToken, database
from models.change_feed import TOKENS_CHANNEL, suffix_of
from models.clock import iso, to_db, utcnow
from models.db import is_postgres
from service.core import audit
from service.core.access import Actor, validate_user_id
from service.core.errors import NotFoundError, PermissionDeniedError, ValidationError
from service.core.inputs import ascii_digits, user_time

log = logging.getLogger("logic.core")

API_TOKEN_PREFIX = "lat_"
LOGIN_TOKEN_TTL = timedelta(minutes=15)
#: PostgreSQL channel a revocation is announced on (service.core.tokencache listens).
REVOKED_CHANNEL = TOKENS_CHANNEL   # listened to by models.change_feed.ChangeFeed
#: NOTIFY on `scoped(REVOKED_CHANNEL, <the schema of api_token>)`, named in SQL.
REVOKED_NOTIFY_SQL = f"SELECT pg_notify(%s || {suffix_of('api_token')}, '')"
TOUCH_EVERY = timedelta(minutes=1)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def create_api_token(actor: Actor, user_id: str | None = None, *,
                     expires_at: datetime | None = None) -> dict[str, Any]:
    """Create a token acting as `user_id`, or as the operator when None
    (operator only), optionally expiring at `expires_at` (UTC).  Returns
    `{"token", "kind", "userId", "id", "createdAt", "expiresAt"}` once.
    Raises `PermissionDeniedError`, `ValidationError`."""
    if not actor.is_operator:
        raise PermissionDeniedError("only the operator may create API tokens")
    if user_id is not None:
        validate_user_id(user_id)
    now = utcnow()
    if expires_at is not None:
        expires_at = user_time(expires_at, field="expiresAt", code="invalid_input")
        if expires_at <= now:
            raise ValidationError("expiresAt must be in the future", code="invalid_expiry")
    token = API_TOKEN_PREFIX + secrets.token_urlsafe(32)
    kind = "operator" if user_id is None else "user"
    with database.atomic():
        row = ApiToken.create(token_hash=_digest(token), hint=token[-4:], kind=kind,
                              user_id=user_id, created_at=now, expires_at=expires_at)
        audit.record(actor, "token.created", kind=kind, user=user_id, token_id=row.id)
    return {"id": row.id, "token": token, "kind": kind, "userId": user_id,
            "createdAt": iso(row.created_at), "expiresAt": iso(expires_at)}


@dataclass(frozen=True)
class TokenIdentity:
    """Who a valid API token is: its id, its actor, when it expires."""

    token_id: int
    actor: Actor
    expires_at: datetime | None

    def expired(self, now: datetime) -> bool:
        return self.expires_at is not None and self.expires_at <= now


def lookup_api_token(token: str) -> TokenIdentity | None:
    """The identity behind an API token, or None (unknown, revoked or
    expired).  One indexed query; updates `lastUsedAt` at most once a minute."""
    if not token or not token.startswith(API_TOKEN_PREFIX) or len(token) > 100:
        return None
    row = ApiToken.get_or_none((ApiToken.token_hash == _digest(token))
                               & ApiToken.revoked_at.is_null())
    if row is None:
        return None
    now = utcnow()
    identity = TokenIdentity(row.id, Actor.operator() if row.kind == "operator"
                             else Actor(row.user_id), to_db(row.expires_at) if row.expires_at else None)
    if identity.expired(now):
        return None
    if row.last_used_at is None or to_db(row.last_used_at) < now - TOUCH_EVERY:
        touch_api_token(row.id)
    return identity


def touch_api_token(token_id: int) -> None:
    """Set `lastUsedAt` to now (callers do it at most once a minute per token)."""
    ApiToken.update(last_used_at=utcnow()).where(ApiToken.id == token_id).execute()


def authenticate_token(token: str) -> Actor | None:
    """The actor behind an API token, or None (unknown, revoked or expired).
    The admin API then applies `X-Acting-User` for operator tokens itself."""
    identity = lookup_api_token(token)
    return identity.actor if identity is not None else None


def revoke_api_token(actor: Actor, token_id: int | str) -> int:
    """Revoke a token by id (operator only): an int, or its ASCII digits as
    the API and the CLI receive them.  Returns the id.  Raises
    `PermissionDeniedError`, `NotFoundError` (`token_not_found`, also for an
    id that is not ASCII digits: "١" never names token 1)."""
    if not actor.is_operator:
        raise PermissionDeniedError("only the operator may revoke API tokens")
    if isinstance(token_id, str):
        if not ascii_digits(token_id):
            raise NotFoundError(f"token {token_id[:40]} not found", code="token_not_found")
        token_id = int(token_id)
    with database.atomic():
        n = (ApiToken.update(revoked_at=utcnow())
             .where((ApiToken.id == token_id) & ApiToken.revoked_at.is_null()).execute())
        if not n:
            raise NotFoundError(f"token {token_id} not found", code="token_not_found")
        audit.record(actor, "token.revoked", token_id=token_id)
        if is_postgres():
            # Delivered to every node's listener when this transaction commits
            # (service.core.tokencache): their caches forget every token at once.
            # On this schema's own channel (models.change_feed.scoped), and on the
            # unscoped one for nodes of the release before.
            database.execute_sql(REVOKED_NOTIFY_SQL, (REVOKED_CHANNEL + "_",))
            database.execute_sql(f"NOTIFY {REVOKED_CHANNEL}")
    return token_id


def create_login_link(actor: Actor, user_id: str, base_url: str,
                      ttl: timedelta = LOGIN_TOKEN_TTL, *, audit_as: Actor | None = None,
                      guild_id: str | None = None) -> dict[str, Any]:
    """A one-time link `{base_url}/login/{token}` for `user_id` (operator
    only).  `audit_as` and `guild_id` name who asked in the audit record when
    another rule has already allowed it (`service.core.member_links`).
    Raises `PermissionDeniedError`, `ValidationError`."""
    if not actor.is_operator:
        raise PermissionDeniedError("only the operator may create login links")
    validate_user_id(user_id)
    token = secrets.token_urlsafe(32)
    now = utcnow()
    with database.atomic():
        # Links are short-lived: sweep the spent ones so the table stays small.
        LoginToken.delete().where(LoginToken.expires_at < now - timedelta(days=1)).execute()
        LoginToken.create(token_hash=_digest(token), user_id=user_id, created_at=now,
                          expires_at=now + ttl)
        audit.record(audit_as or actor, "login_link.created", guild_id=guild_id, user=user_id)
    return {"url": f"{base_url.rstrip('/')}/login/{token}", "userId": user_id,
            "expiresAt": iso(now + ttl)}


def spend_login_links(user_id: str, now: datetime) -> int:
    """Mark every login link of `user_id` not yet used as used (the caller's
    transaction, e.g. ending the user's sessions); return how many."""
    return int(LoginToken.update(used_at=now)
               .where((LoginToken.user_id == user_id) & LoginToken.used_at.is_null()).execute())


def login_link_user(token: str) -> str:
    """The user a login link is for, without using it.  Raises `NotFoundError`
    (`invalid_login_token`) when unknown, used or expired."""
    row = LoginToken.get_or_none((LoginToken.token_hash == _digest(token or ""))
                                 & LoginToken.used_at.is_null()
                                 & (LoginToken.expires_at > utcnow()))
    if row is None:
        raise NotFoundError("login link is invalid, used or expired", code="invalid_login_token")
    return str(row.user_id)


def consume_login_token(token: str) -> str:
    """Use a login token once; return its user id.  Raises `NotFoundError`
    (`invalid_login_token`) when unknown, used or expired."""
    now = utcnow()
    digest = _digest(token or "")
    with database.atomic():
        used = (LoginToken.update(used_at=now)
                .where((LoginToken.token_hash == digest) & LoginToken.used_at.is_null()
                       & (LoginToken.expires_at > now)).execute())
        if used != 1:
            raise NotFoundError("login link is invalid, used or expired", code="invalid_login_token")
        return str(LoginToken.get(LoginToken.token_hash == digest).user_id)
