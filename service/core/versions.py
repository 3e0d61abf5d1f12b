"""Script versions: every saved source is kept (the newest N per script), listed and restored.

N is the plan's history size, at least `MIN_KEPT`; versions past the newest
`MIN_KEPT` are kept only while the script's kept sources come to at most
`KEPT_BYTES`, so a script keeps about 4 MiB of versions at most, whatever the
plan (ten sources of 256 KB are 2.5 MiB).  `keep(...)` runs inside
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
#: Versions past the newest `MIN_KEPT` are dropped once a script's kept sources
#: would pass this many UTF-8 bytes.
KEPT_BYTES = 4 << 20


def kept(plan: Plan) -> int:
    """How many versions a script on `plan` keeps."""
    return max(MIN_KEPT, plan.history)


def keep(actor: Actor, script: Script, plan: Plan) -> None:
    """Store `script`'s current source as its version and prune the oldest."""
    source = str(script.source)
    # Versions a node of the release before migration 0011 saved carry the
    # column's default, 0: sized here, before they count against the budget.
    for row in ScriptVersion.select(ScriptVersion.id, ScriptVersion.source).where(
            (ScriptVersion.script == script.id) & (ScriptVersion.source_bytes == 0)):
        size = len(str(row.source).encode("utf-8"))
        if size:
            ScriptVersion.update(source_bytes=size).where(ScriptVersion.id == row.id).execute()
    ScriptVersion.create(script=script.id, version=script.version, source=source,
                         source_bytes=len(source.encode("utf-8")), author=actor.label,
                         created_at=utcnow())
    most, total, drop = kept(plan), 0, []
    rows = (ScriptVersion.select(ScriptVersion.id, ScriptVersion.source_bytes)
            .where(ScriptVersion.script == script.id).order_by(ScriptVersion.version.desc()))
    for i, row in enumerate(rows):
        total += row.source_bytes
        if i >= most or (i >= MIN_KEPT and total > KEPT_BYTES):
            drop.append(row.id)      # and every older one: both tests only grow
    if drop:
        ScriptVersion.delete().where(ScriptVersion.id.in_(drop)).execute()


def list_versions(actor: Actor, guild_id: str, script_id: str, *,
                  plans: Mapping[str, Plan] = DEFAULT_PLANS) -> dict[str, Any]:
    """`{"current", "kept", "versions": [{"version", "time", "author", "sourceBytes"}]}`,
    newest first.  Raises `NotFoundError`, `PermissionDeniedError`."""
    guild, script, _ = guild_and_script(actor, guild_id, script_id, "view scripts")
    rows = (ScriptVersion.select(ScriptVersion.version, ScriptVersion.created_at,
                                 ScriptVersion.author, ScriptVersion.source_bytes)
            .where(ScriptVersion.script == script.id)
            .order_by(ScriptVersion.version.desc()))
    return {"logicScriptId": script.public_id, "current": script.version,
            "kept": kept(resolve_plan(plans, guild.plan)),
            "versions": [{"version": r.version, "time": iso(r.created_at), "author": r.author,
                          "sourceBytes": r.source_bytes} for r in rows]}


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
