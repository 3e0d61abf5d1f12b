"""Audit trail: append and read `AuditRecord`s.

Callers pass IDs and settings only; a secret never reaches this module."""
from __future__ import annotations

import json
from typing import Any

from models import AuditRecord
from models.clock import iso, utcnow
from service.core.access import EDITORS, Actor, get_guild, require_role


def record(actor: Actor, action: str, *, guild_id: str | None = None,
           script_id: str | None = None, **detail: Any) -> None:
    """Append one audit record (inside the caller's transaction).  The front
    the actor came through, when named (`Actor.via`), is kept as `detail.via`."""
    if actor.via is not None:
        detail["via"] = actor.via
    AuditRecord.create(time=utcnow(), actor=actor.label, guild_id=guild_id,
                       script_id=script_id, action=action,
                       detail=json.dumps(detail, sort_keys=True))


def audit_log(actor: Actor, guild_id: str, limit: int = 100) -> dict[str, Any]:
    """The guild's newest audit records: `{"audit": [...]}`.
    Raises `NotFoundError`, `PermissionDeniedError`."""
    guild = get_guild(guild_id)
    require_role(actor, guild, EDITORS, "read the audit log")
    rows = (AuditRecord.select().where(AuditRecord.guild_id == guild.id)
            .order_by(AuditRecord.id.desc()).limit(max(1, min(limit, 1000))))
    return {"audit": [{"id": r.id, "time": iso(r.time), "actor": r.actor, "action": r.action,
                       "logicScriptId": r.script_id, "detail": json.loads(r.detail)}
                      for r in rows]}
