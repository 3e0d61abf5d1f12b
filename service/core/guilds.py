"""Guilds: create, show, change plan (with downgrade), managers."""
from __future__ import annotations

import logging
from typing import Any, Mapping

from peewee import IntegrityError

from models import Endpoint, Guild, GuildManager, Script, database
from models.clock import iso, utcnow
from service.core import audit
from service.core.access import (EDITORS, Actor, Role, get_guild, require_role,
                                 validate_guild_id, validate_user_id)
from service.core.errors import ConflictError, NotFoundError, PermissionDeniedError, ValidationError
from service.plans import DEFAULT_PLAN_NAME, DEFAULT_PLANS, PLAN_KEYS, Plan, resolve_plan

log = logging.getLogger("logic.core")

#: Managers a guild may have (each is a row, listed in every view of the guild).
MAX_MANAGERS = 100


def _check_plan(plans: Mapping[str, Plan], name: str) -> Plan:
    if name not in plans:
        raise ValidationError(f"unknown plan {name!r} (known: {', '.join(sorted(plans))})",
                              code="unknown_plan")
    return plans[name]


def _camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(part.capitalize() for part in rest)


def plan_limits(plan: Plan) -> dict[str, Any]:
    """A plan's settings in the API's camelCase (`memory_kb` -> `memoryKb`);
    0 or false means the plan does not include it."""
    return {_camel(key): getattr(plan, key) for key in PLAN_KEYS}


def guild_view(guild: Guild, plans: Mapping[str, Plan]) -> dict[str, Any]:
    """The JSON shape of a guild, with its plan's `limits`."""
    managers = [m.user_id for m in GuildManager.select(GuildManager.user_id)
                .where(GuildManager.guild == guild.id).order_by(GuildManager.user_id)]
    plan = resolve_plan(plans, guild.plan)
    enabled = (Endpoint.select().join(Script)
               .where((Script.guild == guild.id) & Script.deleted_at.is_null() & Endpoint.enabled)
               .count())
    return {"guildId": guild.id, "ownerId": guild.owner_id, "plan": guild.plan,
            "managers": managers, "endpointsEnabled": enabled,
            "endpointsAllowed": plan.endpoints, "limits": plan_limits(plan),
            "createdAt": iso(guild.created_at)}


def create_guild(actor: Actor, guild_id: str, owner_id: str, plan: str | None = None, *,
                 plans: Mapping[str, Plan] = DEFAULT_PLANS) -> dict[str, Any]:
    """Register a guild (operator only).  Raises `ValidationError`,
    `ConflictError` (exists), `PermissionDeniedError`."""
    if not actor.is_operator:
        raise PermissionDeniedError("only the operator may create guilds")
    validate_guild_id(guild_id)
    validate_user_id(owner_id)
    plan_name = plan or DEFAULT_PLAN_NAME
    _check_plan(plans, plan_name)
    try:
        with database.atomic():
            guild = Guild.create(id=guild_id, owner_id=owner_id, plan=plan_name,
                                 created_at=utcnow())
            audit.record(actor, "guild.created", guild_id=guild_id, owner=owner_id,
                         plan=plan_name)
    except IntegrityError:      # the primary key decides, even between racing creates
        raise ConflictError(f"guild {guild_id} already exists", code="guild_exists") from None
    log.info("guild %s created by %s", guild_id, actor.label)
    return guild_view(guild, plans)


def show_guild(actor: Actor, guild_id: str, *,
               plans: Mapping[str, Plan] = DEFAULT_PLANS) -> dict[str, Any]:
    """The guild.  Raises `NotFoundError`, `PermissionDeniedError`."""
    guild = get_guild(guild_id)
    require_role(actor, guild, EDITORS, "view the guild")
    return guild_view(guild, plans)


def list_guilds(actor: Actor, *,
                plans: Mapping[str, Plan] = DEFAULT_PLANS) -> dict[str, Any]:
    """`{"guilds": [...]}`: every guild for the operator, else the guilds the
    user owns or manages (what the dashboard lists after login)."""
    query = Guild.select().order_by(Guild.id)
    if not actor.is_operator:
        managed = GuildManager.select(GuildManager.guild).where(GuildManager.user_id == actor.user_id)
        query = query.where((Guild.owner_id == actor.user_id) | Guild.id.in_(managed))
    return {"guilds": [guild_view(g, plans) for g in query]}


def plan_differences(old: Plan, new: Plan) -> dict[str, dict[str, Any]]:
    """The limits that differ between two plans: `{key: {"old", "new"}}`."""
    return {k: {"old": getattr(old, k), "new": getattr(new, k)} for k in PLAN_KEYS
            if getattr(old, k) != getattr(new, k)}


def set_plan(actor: Actor, guild_id: str, plan: str, *,
             plans: Mapping[str, Plan] = DEFAULT_PLANS, dry_run: bool = False) -> dict[str, Any]:
    """Change the guild's plan (operator only).  A downgrade disables the
    enabled endpoints over the new quota, most recently enabled first, and
    audits each; on a plan without the whitelist feature stored whitelists
    are kept but not enforced.  Returns the guild plus `"disabled": [script
    ids]`, `"changes"` (limits old/new), `"whitelistsSuspended"` and
    `"whitelistsResumed"` (script ids) and `"dryRun"`.  With `dry_run`
    nothing is written.  Raises `ValidationError`, `NotFoundError`,
    `PermissionDeniedError`."""
    new_plan = _check_plan(plans, plan)
    with database.atomic() as txn:
        guild = get_guild(guild_id, lock=True)
        require_role(actor, guild, (Role.OPERATOR,), "change the plan")
        old = guild.plan
        old_plan = resolve_plan(plans, old)
        rows = list(Endpoint.select(Endpoint, Script).join(Script)
                    .where((Script.guild == guild.id) & Script.deleted_at.is_null()
                           & Endpoint.enabled)
                    .order_by(Endpoint.enabled_at.desc(), Endpoint.id.desc()))
        over = rows[: max(0, len(rows) - new_plan.endpoints)]
        listed = [e.script.public_id for e in
                  Endpoint.select(Endpoint, Script).join(Script)
                  .where((Script.guild == guild.id) & Script.deleted_at.is_null()
                         & (Endpoint.whitelist != "[]") & (Endpoint.whitelist != ""))
                  .order_by(Script.id)]
        suspended = listed if old_plan.ip_whitelist and not new_plan.ip_whitelist else []
        resumed = listed if new_plan.ip_whitelist and not old_plan.ip_whitelist else []
        changes = plan_differences(old_plan, new_plan)
        disabled = [e.script.public_id for e in over]
        if not dry_run:
            for endpoint in over:
                Endpoint.update(enabled=False).where(Endpoint.id == endpoint.id).execute()
                audit.record(actor, "endpoint.disabled", guild_id=guild.id,
                             script_id=endpoint.script.public_id, reason="plan_downgrade",
                             plan=plan, old=True, new=False)
            if old != plan:
                Guild.update(plan=plan).where(Guild.id == guild.id).execute()
                guild.plan = plan
                audit.record(actor, "plan.changed", guild_id=guild.id, old=old, new=plan,
                             disabled=disabled, changes=changes,
                             whitelists_suspended=suspended, whitelists_resumed=resumed)
        else:
            txn.rollback()
    if not dry_run:
        log.info("guild %s plan %s -> %s by %s; %d endpoint(s) disabled",
                 guild.id, old, plan, actor.label, len(disabled))
    view = guild_view(guild, plans)
    if dry_run:
        view["plan"] = plan
        view["endpointsAllowed"] = new_plan.endpoints
        view["limits"] = plan_limits(new_plan)
        view["endpointsEnabled"] -= len(disabled)
    view.update({"disabled": disabled, "changes": changes, "whitelistsSuspended": suspended,
                 "whitelistsResumed": resumed, "dryRun": dry_run, "oldPlan": old})
    return view


def add_manager(actor: Actor, guild_id: str, user_id: str, *,
                plans: Mapping[str, Plan] = DEFAULT_PLANS) -> dict[str, Any]:
    """Add a manager (owner or operator).  Idempotent.  Raises
    `ValidationError`, `ConflictError` (`manager_limit`: `MAX_MANAGERS`),
    `NotFoundError`, `PermissionDeniedError`."""
    validate_user_id(user_id)
    with database.atomic():
        guild = get_guild(guild_id, lock=True)     # serialises the count
        require_role(actor, guild, (Role.OWNER, Role.OPERATOR), "add managers")
        if user_id == guild.owner_id:
            raise ValidationError("the owner is not added as a manager", code="is_owner")
        managers = GuildManager.select().where(GuildManager.guild == guild.id)
        if (managers.count() >= MAX_MANAGERS
                and not managers.where(GuildManager.user_id == user_id).exists()):
            raise ConflictError(f"guild {guild.id} has {MAX_MANAGERS} managers, the most it "
                                "may have: remove one first", code="manager_limit")
        try:
            with database.atomic():      # savepoint: a racing duplicate is not an error
                GuildManager.create(guild=guild.id, user_id=user_id, created_at=utcnow())
                audit.record(actor, "manager.added", guild_id=guild.id, user=user_id)
        except IntegrityError:
            pass
    return guild_view(guild, plans)


def remove_manager(actor: Actor, guild_id: str, user_id: str, *,
                   plans: Mapping[str, Plan] = DEFAULT_PLANS) -> dict[str, Any]:
    """Remove a manager (owner or operator).  Raises `NotFoundError`
    (not a manager), `ValidationError`, `PermissionDeniedError`."""
    validate_user_id(user_id)   # as for add: an id that is none is never echoed back
    with database.atomic():
        guild = get_guild(guild_id)
        require_role(actor, guild, (Role.OWNER, Role.OPERATOR), "remove managers")
        deleted = (GuildManager.delete().where((GuildManager.guild == guild.id)
                                               & (GuildManager.user_id == user_id)).execute())
        if not deleted:
            raise NotFoundError(f"user {user_id} is not a manager of guild {guild.id}",
                                code="manager_not_found")
        audit.record(actor, "manager.removed", guild_id=guild.id, user=user_id)
    return guild_view(guild, plans)
