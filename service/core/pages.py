"""Paged reads for the admin API: `{"items": [...], "nextCursor": str | None}`.

Keyset pagination: a cursor names the last key of the page before (an opaque
URL-safe string), and the next page holds the rows strictly after it in the
list's order.  Rows inserted meanwhile never shift a page: history, errors and
audit are newest first by id, and new rows get higher ids, so they appear only
before the first page; guilds and scripts are oldest first by key, so new ones
appear after the last page.  `limit` defaults to 50, at most 200.

History filters: `status` is `2xx`, `4xx`, `5xx` (any class digit) or one code;
`since` an ISO 8601 time (records at or after it).  The same roles as the
unpaged reads (`service.core.reads`, `service.core.guilds`, ...).
"""
from __future__ import annotations

import base64
import binascii
from datetime import datetime, timezone
from typing import Any, Callable, Mapping

from peewee import Field

from models import AuditRecord, ErrorRecord, Guild, GuildManager, RequestRecord, Script
from service.core.access import EDITORS, Actor, get_guild, require_role
from service.core.audit import audit_view
from service.core.errors import NotFoundError, QuotaError, ValidationError
from service.core.guilds import guild_view
from service.core.inputs import ascii_digits, stored_request_id, user_time
from service.core.reads import _endpoint_and_plan, error_view, in_history, record_view
from service.core.record_queries import parse_status
from service.core.scripts import script_view
from service.plans import DEFAULT_PLANS, Plan

DEFAULT_LIMIT = 50
MAX_LIMIT = 200


def encode_cursor(key: int | str) -> str:
    """The opaque cursor after `key`."""
    text = f"i{key}" if isinstance(key, int) else f"s{key}"
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def decode_cursor(cursor: str | None, kind: type) -> int | str | None:
    """The key a cursor names; raises `ValidationError` (`invalid_cursor`)."""
    if cursor is None or cursor == "":
        return None
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        text = ""
    if kind is int and text[:1] == "i" and ascii_digits(text[1:]):
        return int(text[1:])
    if kind is str and text[:1] == "s" and 0 < len(text) <= 65:
        return text[1:]
    raise ValidationError("cursor is not one this API gave out", code="invalid_cursor")


def check_limit(limit: int | None) -> int:
    """`limit` within 1..200 (default 50); raises `ValidationError`."""
    if limit is None:
        return DEFAULT_LIMIT
    if not 1 <= limit <= MAX_LIMIT:
        raise ValidationError(f"limit must be 1-{MAX_LIMIT}", code="invalid_limit")
    return limit


def _page(query: Any, key: Field, limit: int | None, cursor: str | None, kind: type,
          newest_first: bool, view: Callable[[Any], dict[str, Any]],
          key_of: Callable[[Any], int | str]) -> dict[str, Any]:
    n = check_limit(limit)
    after = decode_cursor(cursor, kind)
    if after is not None:
        query = query.where(key < after if newest_first else key > after)
    rows = list(query.order_by(key.desc() if newest_first else key.asc()).limit(n + 1))
    more = len(rows) > n
    rows = rows[:n]
    return {"items": [view(r) for r in rows],
            "nextCursor": encode_cursor(key_of(rows[-1])) if more and rows else None}


def parse_since(since: str | None) -> datetime | None:
    """An ISO 8601 time (a `Z` or offset; naive is UTC); raises `ValidationError`."""
    if not since:
        return None
    try:
        value = datetime.fromisoformat(since.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValidationError("since must be an ISO 8601 time, e.g. 2026-01-31T12:00:00Z",
                              code="invalid_since") from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return user_time(value, field="since", code="invalid_since")


def history_page(actor: Actor, guild_id: str, script_id: str, *, limit: int | None = None,
                 cursor: str | None = None, status: str | None = None, since: str | None = None,
                 plans: Mapping[str, Plan] = DEFAULT_PLANS) -> dict[str, Any]:
    """A page of request records, newest first.  Raises `ValidationError`
    (bad filter or cursor), `NotFoundError`, `PermissionDeniedError`."""
    n = check_limit(limit)
    after = decode_cursor(cursor, int)
    when = parse_since(since)
    span = parse_status(status)   # the CLI's --status rule, one parser for both fronts
    endpoint, plan = _endpoint_and_plan(actor, guild_id, script_id, "read history", plans)
    if plan.history <= 0:
        return {"items": [], "nextCursor": None}
    # Only the plan's newest N are history (older rows wait for a later prune).
    query = RequestRecord.select().where(in_history(endpoint.id, plan.history))
    if span is not None:
        query = query.where(RequestRecord.status.between(*span))
    if when is not None:
        query = query.where(RequestRecord.time >= when)
    cursor_text = encode_cursor(after) if after is not None else None
    return _page(query, RequestRecord.id, n, cursor_text, int, True, record_view, lambda r: r.id)


def history_record(actor: Actor, guild_id: str, script_id: str, request_id: str, *,
                   plans: Mapping[str, Plan] = DEFAULT_PLANS) -> dict[str, Any]:
    """One request record in full, by its request id: only one of the plan's
    newest N (what `history_page` lists).  Raises `NotFoundError`
    (`request_not_found`), `PermissionDeniedError`."""
    endpoint, plan = _endpoint_and_plan(actor, guild_id, script_id, "read history", plans)
    rid = stored_request_id(request_id)
    row = (RequestRecord.select().where(in_history(endpoint.id, plan.history)
                                        & (RequestRecord.request_id == rid))
           .order_by(RequestRecord.id.desc()).first()
           if plan.history > 0 and rid is not None else None)
    if row is None:
        raise NotFoundError(f"request {rid or '(not a request id)'} not found",
                            code="request_not_found")
    return record_view(row)


def errors_page(actor: Actor, guild_id: str, script_id: str, *, limit: int | None = None,
                cursor: str | None = None,
                plans: Mapping[str, Plan] = DEFAULT_PLANS) -> dict[str, Any]:
    """A page of error records, newest first.  Raises `QuotaError`
    (`plan_feature`), `ValidationError`, `NotFoundError`, `PermissionDeniedError`."""
    endpoint, plan = _endpoint_and_plan(actor, guild_id, script_id, "read error logs", plans)
    if not plan.error_logs:
        raise QuotaError(f"plan {plan.name} does not include error logs", code="plan_feature")
    query = ErrorRecord.select().where(ErrorRecord.endpoint == endpoint.id)
    return _page(query, ErrorRecord.id, limit, cursor, int, True, error_view, lambda r: r.id)


def audit_page(actor: Actor, guild_id: str, *, limit: int | None = None,
               cursor: str | None = None) -> dict[str, Any]:
    """A page of the guild's audit records, newest first (owner, manager, operator)."""
    guild = get_guild(guild_id)
    require_role(actor, guild, EDITORS, "read the audit log")
    query = AuditRecord.select().where(AuditRecord.guild_id == guild.id)
    return _page(query, AuditRecord.id, limit, cursor, int, True, audit_view, lambda r: r.id)


def guilds_page(actor: Actor, *, limit: int | None = None, cursor: str | None = None,
                plans: Mapping[str, Plan] = DEFAULT_PLANS) -> dict[str, Any]:
    """A page of the guilds the actor owns or manages (the operator: all), by id."""
    query = Guild.select()
    if not actor.is_operator:
        managed = GuildManager.select(GuildManager.guild).where(GuildManager.user_id == actor.user_id)
        query = query.where((Guild.owner_id == actor.user_id) | Guild.id.in_(managed))
    return _page(query, Guild.id, limit, cursor, str, False, lambda g: guild_view(g, plans),
                 lambda g: str(g.id))


def scripts_page(actor: Actor, guild_id: str, *, limit: int | None = None,
                 cursor: str | None = None) -> dict[str, Any]:
    """A page of the guild's live scripts, oldest first."""
    guild = get_guild(guild_id)
    require_role(actor, guild, EDITORS, "list scripts")
    query = Script.select().where((Script.guild == guild.id) & Script.deleted_at.is_null())
    return _page(query, Script.id, limit, cursor, int, False,
                 lambda s: script_view(s, guild.id), lambda s: s.id)


__all__ = ["audit_page", "errors_page", "guilds_page", "history_page", "history_record",
           "scripts_page", "encode_cursor", "decode_cursor"]
