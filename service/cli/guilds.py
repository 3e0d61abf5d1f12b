"""`logic guild`: guilds, plans, managers and the audit trail."""
from __future__ import annotations

from typing import Any

import click

from service import core
from service.cli.base import State, actor_of, as_option, cli, emit, json_option, pass_state, run_core


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
    emit(data, as_json, lambda d: "\n".join(
        f"{g['guildId']}  {g['plan']}  owner {g['ownerId']}  {g['endpointsEnabled']}/{g['endpointsAllowed']} endpoints"
        for g in d["guilds"]) or "(no guilds)")


@guild.command("set-plan")
@click.argument("guild_id")
@click.argument("plan")
@json_option
@pass_state
def guild_set_plan(state: State, guild_id: str, plan: str, as_json: bool) -> None:
    """Change a guild's plan (operator); a downgrade disables endpoints over the quota."""
    emit(run_core(state, lambda: core.set_plan(core.Actor.operator(), guild_id, plan,
                                           plans=state.settings.plans)), as_json)


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
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 1000))
@as_option
@json_option
@pass_state
def guild_audit(state: State, guild_id: str, limit: int, as_user: str | None, as_json: bool) -> None:
    """Show the guild's audit trail, newest first."""
    data = run_core(state, lambda: core.audit_log(actor_of(as_user), guild_id, limit))
    emit(data, as_json, lambda d: "\n".join(
        f"{a['time']} {a['actor']} {a['action']} {a['logicScriptId'] or ''}".rstrip()
        for a in d["audit"]) or "(no audit records)")
