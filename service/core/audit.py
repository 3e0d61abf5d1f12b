"""Audit trail: append and read `AuditRecord`s.

Callers pass IDs and settings only; a secret never reaches this module.
Each guild keeps its newest `AUDIT_KEEP` records (the operator's records
without a guild likewise): a guild's editors renaming a script in a loop
grew the trail without bound (security review, session 16). The oldest are
deleted every `PRUNE_EVERY` records a process writes for that guild, so a
guild holds at most `AUDIT_KEEP` plus that slack per process."""
from __future__ import annotations

import json
import threading
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
    with _lock:
        written = _since_prune.get(guild_id, 0) + 1
        due = written >= PRUNE_EVERY
        _since_prune[guild_id] = 0 if due else written
        if len(_since_prune) > 10_000:     # bound the memo; an early prune is harmless
            _since_prune.clear()
    if due:
        _prune(guild_id)


#: Audit records kept per guild (the audit API shows at most the newest 1,000).
AUDIT_KEEP = 10_000
PRUNE_EVERY = 100
_since_prune: dict[str | None, int] = {}
_lock = threading.Lock()


def _prune(guild_id: str | None) -> None:
    """Delete what is older than the guild's newest `AUDIT_KEEP` records."""
    mine = (AuditRecord.guild_id.is_null() if guild_id is None
            else AuditRecord.guild_id == guild_id)
    cutoff = (AuditRecord.select(AuditRecord.id).where(mine).order_by(AuditRecord.id.desc())
              .offset(AUDIT_KEEP).limit(1).scalar())
    if cutoff is not None:
        AuditRecord.delete().where(mine & (AuditRecord.id <= cutoff)).execute()


def audit_log(actor: Actor, guild_id: str, limit: int = 100) -> dict[str, Any]:
    """The guild's newest audit records: `{"audit": [...]}`.
    Raises `NotFoundError`, `PermissionDeniedError`."""
    guild = get_guild(guild_id)
    require_role(actor, guild, EDITORS, "read the audit log")
    rows = (AuditRecord.select().where(AuditRecord.guild_id == guild.id)
            .order_by(AuditRecord.id.desc()).limit(max(1, min(limit, 1000))))
    return {"audit": [audit_view(r) for r in rows]}


def audit_view(r: AuditRecord) -> dict[str, Any]:
    """The JSON shape of one audit record."""
    return {"id": r.id, "time": iso(r.time), "actor": r.actor, "action": r.action,
            "logicScriptId": r.script_id, "detail": json.loads(r.detail)}
