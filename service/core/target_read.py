"""The invoke path's one read: everything a request needs, in one indexed query.

`load_target(guild_id, script_id, plans)` joins script (unique index on the
public ID), guild (primary key) and endpoint (unique index on the script) and
returns an `InvokeTarget`, or None for an unknown guild/script or a deleted
script (the HTTP layer answers 404 `endpoint_not_found`).  No role checks: the
caller authenticates with the endpoint secret.  `service.core.invoke_target`'s
`TargetCache` remembers its answers.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

from peewee import Database

from models import Endpoint, Guild, Script
from models.db import database
from service.core.endpoints import parse_whitelist
from service.plans import DEFAULT_PLANS, Plan, resolve_plan

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class InvokeTarget:
    """What the invoke handler needs; `enabled` and `whitelist` already fold in the plan."""

    endpoint_id: int
    guild_id: str
    script_id: str
    script_version: int
    source: str
    enabled: bool
    plan: Plan
    secret_hash: str | None
    whitelist: tuple[IPNetwork, ...]


_GUILD_MARK, _SCRIPT_MARK = "\x00guild", "\x00script"


def _query(guild_id: str, script_id: str) -> Any:
    return (Script.select(Script.version, Script.source, Guild.plan, Endpoint.id,
                          Endpoint.enabled, Endpoint.secret_hash, Endpoint.whitelist)
            .join(Guild, on=(Guild.id == Script.guild))
            .join(Endpoint, on=(Endpoint.script == Script.id))
            .where((Script.public_id == script_id) & (Script.guild == guild_id)
                   & Script.deleted_at.is_null()))


@lru_cache(maxsize=8)
def _compiled(db: Database) -> tuple[str, tuple[int, int]]:
    """The lookup's SQL for `db`, built once, and where its two parameters go.

    Building a peewee query costs more than running it on SQLite, and this runs
    on every request; the SQL text never changes for a given database.
    """
    sql, params = _query(_GUILD_MARK, _SCRIPT_MARK).sql()
    return sql, (params.index(_GUILD_MARK), params.index(_SCRIPT_MARK))


@lru_cache(maxsize=4096)
def _whitelist(stored: str) -> tuple[IPNetwork, ...]:
    return parse_whitelist(stored)


def load_target(guild_id: str, script_id: str,
                plans: Mapping[str, Plan] = DEFAULT_PLANS) -> InvokeTarget | None:
    """The endpoint behind `POST /endpoints/{guild_id}/{script_id}`, or None."""
    # Cheap shape checks first: a malformed ID never reaches the database.
    if not (guild_id.isascii() and guild_id.isdigit() and 0 < len(guild_id) <= 25
            and script_id.startswith("logic_") and len(script_id) == 28):
        return None
    db = database.obj
    sql, (guild_at, script_at) = _compiled(db)
    params: list[str] = ["", ""]
    params[guild_at], params[script_at] = guild_id, script_id
    row = db.execute_sql(sql, params).fetchone()
    if row is None:
        return None
    version, source, plan_name, endpoint_id, enabled, secret_hash, whitelist = row
    plan = resolve_plan(plans, plan_name)
    return InvokeTarget(
        endpoint_id=endpoint_id, guild_id=guild_id, script_id=script_id,
        script_version=version, source=source,
        enabled=bool(enabled) and plan.endpoints > 0, plan=plan,
        secret_hash=secret_hash,
        # A plan without the whitelist feature does not enforce a stored one
        # (kept, enforced again after an upgrade; docs/operations.md).
        whitelist=_whitelist(whitelist or "[]") if plan.ip_whitelist else (),
    )
