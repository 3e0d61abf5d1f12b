"""`logic guild`: guilds, plans, managers and the audit trail."""
from __future__ import annotations

from typing import Any

import click

from service.cli.base import core, State, actor_of, as_option, cli, emit, json_option, pass_state, run_core, WholeNumber
from service.cli.output import local_time, table


@cli.group()
def guild() -> None:
    """Guilds, plans and managers."""


@guild.command("create")
@click.argument("guild_id")
@click.option("--owner", "owner_id", required=True, metavar="USER_ID")
@click.option("--plan", default=None, help="Plan name (default: free).")
@json_option
@pass_state
def guild_create(state: State, guild_id: str, owner_id: str, plan: str | None, as_json: bool) -> None:
    """Register a guild (operator)."""
    emit(run_core(state, lambda: core.create_guild(
        core.Actor.operator(), guild_id, owner_id, plan, plans=state.settings.plans)), as_json)


@guild.command("show")
@click.argument("guild_id")
@as_option
@json_option
@pass_state
def guild_show(state: State, guild_id: str, as_user: str | None, as_json: bool) -> None:
    """Show a guild: owner, plan, managers, endpoint usage."""
    emit(run_core(state, lambda: core.show_guild(actor_of(as_user), guild_id,
                                             plans=state.settings.plans)), as_json)


@guild.command("list")
@as_option
@json_option
@pass_state
def guild_list(state: State, as_user: str | None, as_json: bool) -> None:
    """List guilds: all for the operator, owned or managed with --as."""
    data = run_core(state, lambda: core.list_guilds(actor_of(as_user), plans=state.settings.plans))
    emit(data, as_json, lambda d: table(
        ("GUILD", "PLAN", "OWNER", "ENDPOINTS", "MANAGERS", "CREATED"),
        [(g["guildId"], g["plan"], g["ownerId"], f"{g['endpointsEnabled']}/{g['endpointsAllowed']}",
          len(g["managers"]), local_time(g["createdAt"])) for g in d["guilds"]],
        empty="(no guilds)"))


@guild.command("set-plan")
@click.argument("guild_id")
@click.argument("plan")
@click.option("--dry-run", is_flag=True, help="Show what the change would do; change nothing.")
@json_option
@pass_state
def guild_set_plan(state: State, guild_id: str, plan: str, dry_run: bool, as_json: bool) -> None:
    """Change a guild's plan (operator); a downgrade disables endpoints over the
    quota and stops enforcing whitelists when the new plan has none."""
    emit(run_core(state, lambda: core.set_plan(core.Actor.operator(), guild_id, plan,
                                               plans=state.settings.plans, dry_run=dry_run)),
         as_json, _plan_text)


def _plan_text(d: dict[str, Any]) -> str:
    verb = "would change" if d["dryRun"] else "changed"
    if d["oldPlan"] == d["plan"]:
        lines = [f"guild {d['guildId']} is already on plan {d['plan']}"]
    else:
        lines = [f"guild {d['guildId']}: plan {verb} from {d['oldPlan']} to {d['plan']}"]
    for key, change in d["changes"].items():
        lines.append(f"  {key}: {change['old']} -> {change['new']}")
    would = "would be" if d["dryRun"] else "were"
    if d["disabled"]:
        lines.append(f"endpoints that {would} disabled (over the quota of "
                     f"{d['endpointsAllowed']}): {', '.join(d['disabled'])}")
    if d["whitelistsSuspended"]:
        lines.append(f"IP whitelists kept but no longer enforced: {', '.join(d['whitelistsSuspended'])}")
    if d["whitelistsResumed"]:
        lines.append(f"IP whitelists enforced again: {', '.join(d['whitelistsResumed'])}")
    if d["dryRun"]:
        lines.append("(dry run: nothing was changed)")
    return "\n".join(lines)


@guild.command("add-manager")
@click.argument("guild_id")
@click.argument("user_id")
@as_option
@json_option
@pass_state
def guild_add_manager(state: State, guild_id: str, user_id: str, as_user: str | None,
                      as_json: bool) -> None:
    """Add a manager (owner or operator)."""
    emit(run_core(state, lambda: core.add_manager(actor_of(as_user), guild_id, user_id,
                                              plans=state.settings.plans)), as_json)


@guild.command("remove-manager")
@click.argument("guild_id")
@click.argument("user_id")
@as_option
@json_option
@pass_state
def guild_remove_manager(state: State, guild_id: str, user_id: str, as_user: str | None,
                         as_json: bool) -> None:
    """Remove a manager (owner or operator)."""
    emit(run_core(state, lambda: core.remove_manager(actor_of(as_user), guild_id, user_id,
                                                 plans=state.settings.plans)), as_json)


@guild.command("audit")
@click.argument("guild_id")
@click.option("--limit", default=100, show_default=True, type=WholeNumber(1, 1000),
              help="Show at most N entries, 1-1000.")
@as_option
@json_option
@pass_state
def guild_audit(state: State, guild_id: str, limit: int, as_user: str | None, as_json: bool) -> None:
    """Show the guild's audit trail, newest first."""
    data = run_core(state, lambda: core.audit_log(actor_of(as_user), guild_id, limit))
    emit(data, as_json, lambda d: table(
        ("TIME", "ACTOR", "ACTION", "SCRIPT", "DETAIL"),
        [(local_time(a["time"]), a["actor"], a["action"], a["logicScriptId"] or "",
          _detail(a["detail"])) for a in d["audit"]], empty="(no audit records)"))


def _short(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def _detail(detail: dict[str, Any]) -> str:
    """`old -> new` first, then the other keys (nested changes as `key old -> new`)."""
    parts = []
    if "old" in detail or "new" in detail:
        parts.append(f"{_short(detail.get('old'))} -> {_short(detail.get('new'))}")
    for key, value in sorted(detail.items()):
        if key in ("old", "new") or value in ([], {}, None, False):
            continue
        if isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()):
            value = ", ".join(f"{k} {_short(v.get('old'))} -> {_short(v.get('new'))}"
                              for k, v in value.items())
        parts.append(f"{key}={_short(value)}")
    return "; ".join(parts)
