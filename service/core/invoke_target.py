"""The invoke path's one read: everything a request needs, in one indexed query.

`load_target(guild_id, script_id, plans)` joins script (unique index on the
public ID), guild (primary key) and endpoint (unique index on the script) and
returns an `InvokeTarget`, or None for an unknown guild/script or a deleted
script (the HTTP layer answers 404 `endpoint_not_found`).  No role checks: the
caller authenticates with the endpoint secret.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Mapping

from models import Endpoint, Guild, Script
from service.core.endpoints import parse_whitelist
from service.plans import DEFAULT_PLANS, Plan, resolve_plan

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class InvokeTarget:
    """What the invoke handler needs; `enabled` already folds in the plan."""

    endpoint_id: int
    guild_id: str
    script_id: str
    script_version: int
    source: str
    enabled: bool
    plan: Plan
    secret_hash: str | None
    whitelist: tuple[IPNetwork, ...]


def load_target(guild_id: str, script_id: str,
                plans: Mapping[str, Plan] = DEFAULT_PLANS) -> InvokeTarget | None:
    """The endpoint behind `POST /endpoints/{guild_id}/{script_id}`, or None."""
    # Cheap shape checks first: a malformed ID never reaches the database.
    if not (guild_id.isdigit() and 0 < len(guild_id) <= 25
            and script_id.startswith("logic_") and len(script_id) == 28):
        return None
    row = (Script.select(Script.version, Script.source, Guild.plan, Endpoint.id.alias("endpoint_id"),
                         Endpoint.enabled, Endpoint.secret_hash, Endpoint.whitelist)
           .join(Guild, on=(Guild.id == Script.guild))
           .join(Endpoint, on=(Endpoint.script == Script.id))
           .where((Script.public_id == script_id) & (Script.guild == guild_id)
                  & Script.deleted_at.is_null())
           .dicts().first())
    if row is None:
        return None
    plan = resolve_plan(plans, row["plan"])
    return InvokeTarget(
        endpoint_id=row["endpoint_id"], guild_id=guild_id, script_id=script_id,
        script_version=row["version"], source=row["source"],
        enabled=bool(row["enabled"]) and plan.endpoints > 0, plan=plan,
        secret_hash=row["secret_hash"], whitelist=parse_whitelist(row["whitelist"]),
    )
