"""Script versions: every saved source is kept (the newest N per script), listed and restored.

N is the plan's history size, at least `MIN_KEPT`.  `keep(...)` runs inside
the transaction that saves the source; `rollback` saves an old source as a
new version (the history only grows, so a rollback can itself be undone).
Request and error records name the version that ran (`scriptVersion`).
"""
from __future__ import annotations

from typing import Any, Mapping

from models import Script, ScriptVersion, database
from models.clock import iso, utcnow
from service.core.access import Actor, guild_and_script
from service.core.errors import NotFoundError
from service.plans import DEFAULT_PLANS, Plan, resolve_plan

MIN_KEPT = 10


def kept(plan: Plan) -> int:
    """How many versions a script on `plan` keeps."""
    return max(MIN_KEPT, plan.history)


def keep(actor: Actor, script: Script, plan: Plan) -> None:
    """Store `script`'s current source as its version and prune the oldest."""
    ScriptVersion.create(script=script.id, version=script.version, source=script.source,
                         author=actor.label, created_at=utcnow())
    cutoff = script.version - kept(plan)
    ScriptVersion.delete().where((ScriptVersion.script == script.id)
                                 & (ScriptVersion.version <= cutoff)).execute()


def list_versions(actor: Actor, guild_id: str, script_id: str, *,
                  plans: Mapping[str, Plan] = DEFAULT_PLANS) -> dict[str, Any]:
    """`{"current", "kept", "versions": [{"version", "time", "author", "sourceBytes"}]}`,
    newest first.  Raises `NotFoundError`, `PermissionDeniedError`."""
    guild, script, _ = guild_and_script(actor, guild_id, script_id, "view scripts")
    rows = (ScriptVersion.select().where(ScriptVersion.script == script.id)
            .order_by(ScriptVersion.version.desc()))
    return {"logicScriptId": script.public_id, "current": script.version,
            "kept": kept(resolve_plan(plans, guild.plan)),
            "versions": [{"version": r.version, "time": iso(r.created_at), "author": r.author,
                          "sourceBytes": len(r.source.encode("utf-8"))} for r in rows]}


def version_source(actor: Actor, guild_id: str, script_id: str, version: int) -> str:
    """The source of one kept version.  Raises `NotFoundError` (`version_not_found`)."""
    _, script, _ = guild_and_script(actor, guild_id, script_id, "view scripts")
    row = ScriptVersion.get_or_none((ScriptVersion.script == script.id)
                                    & (ScriptVersion.version == version))
    if row is None:
        raise NotFoundError(f"script {script.public_id} has no kept version {version}",
                            code="version_not_found")
    return str(row.source)


def rollback(actor: Actor, guild_id: str, script_id: str, version: int, *,
             plans: Mapping[str, Plan] = DEFAULT_PLANS) -> dict[str, Any]:
    """Save kept `version`'s source as a new version.  Raises `NotFoundError`
    (`version_not_found`), `ValidationError` (the old source no longer passes
    the checks), `PermissionDeniedError`."""
    from service.core.scripts import update_script
    with database.atomic():
        source = version_source(actor, guild_id, script_id, version)
        view = update_script(actor, guild_id, script_id, source, plans=plans)
    view["restoredFrom"] = version
    return view
