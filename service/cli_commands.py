"""The commands of `logic` (DESIGN section 9) except `serve` and `demo`.

Each command is a thin layer: read arguments, call one service-layer
function, print the result.  Imported by `service.cli` to register them.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from service import core
from service.cli import CommandError, EXIT_USAGE, State, actor_of, as_option, cli, emit, json_option, pass_state


def _read_source(path: str) -> bytes:
    if path == "-":                       # --file - : read the script from stdin
        return sys.stdin.buffer.read()
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise CommandError(f"cannot read {path}: {err.strerror}", EXIT_USAGE) from None


# ------------------------------------------------------------------- db
@cli.group()
def db() -> None:
    """Database schema."""


@db.command("upgrade")
@json_option
@pass_state
def db_upgrade(state: State, as_json: bool) -> None:
    """Bring the database to this release's schema (idempotent)."""
    from models.db import database
    from models.migrate import Runner
    state.open_database(check_schema=False)
    runner = Runner(database.obj)
    before = runner.current_version()
    applied = runner.upgrade()
    data = {"from": before, "to": runner.current_version(), "applied": applied}
    emit(data, as_json, lambda d: (f"database schema upgraded from version {d['from']} to {d['to']}"
                                   if d["applied"] else f"database schema is current (version {d['to']})"))


@db.command("version")
@json_option
@pass_state
def db_version(state: State, as_json: bool) -> None:
    """Show the schema version of the database and of this release."""
    from models.db import database
    from models.migrate import Runner
    state.open_database(check_schema=False)
    runner = Runner(database.obj)
    emit({"current": runner.current_version(), "latest": runner.latest}, as_json)


# ---------------------------------------------------------------- guild
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
    emit(_run(state, lambda: core.create_guild(
        core.Actor.operator(), guild_id, owner_id, plan, plans=state.settings.plans)), as_json)


@guild.command("show")
@click.argument("guild_id")
@as_option
@json_option
@pass_state
def guild_show(state: State, guild_id: str, as_user: str | None, as_json: bool) -> None:
    """Show a guild: owner, plan, managers, endpoint usage."""
    emit(_run(state, lambda: core.show_guild(actor_of(as_user), guild_id,
                                             plans=state.settings.plans)), as_json)


@guild.command("list")
@as_option
@json_option
@pass_state
def guild_list(state: State, as_user: str | None, as_json: bool) -> None:
    """List guilds: all for the operator, owned or managed with --as."""
    data = _run(state, lambda: core.list_guilds(actor_of(as_user), plans=state.settings.plans))
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
    emit(_run(state, lambda: core.set_plan(core.Actor.operator(), guild_id, plan,
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
    emit(_run(state, lambda: core.add_manager(actor_of(as_user), guild_id, user_id,
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
    emit(_run(state, lambda: core.remove_manager(actor_of(as_user), guild_id, user_id,
                                                 plans=state.settings.plans)), as_json)


@guild.command("audit")
@click.argument("guild_id")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 1000))
@as_option
@json_option
@pass_state
def guild_audit(state: State, guild_id: str, limit: int, as_user: str | None, as_json: bool) -> None:
    """Show the guild's audit trail, newest first."""
    data = _run(state, lambda: core.audit_log(actor_of(as_user), guild_id, limit))
    emit(data, as_json, lambda d: "\n".join(
        f"{a['time']} {a['actor']} {a['action']} {a['logicScriptId'] or ''}".rstrip()
        for a in d["audit"]) or "(no audit records)")


# --------------------------------------------------------------- script
@cli.group()
def script() -> None:
    """Scripts."""


@script.command("create")
@click.argument("guild_id")
@click.option("--name", required=True)
@click.option("--file", "path", required=True, metavar="PATH", help="Script file, or - for stdin.")
@as_option
@json_option
@pass_state
def script_create(state: State, guild_id: str, name: str, path: str, as_user: str | None,
                  as_json: bool) -> None:
    """Create a script (its endpoint starts disabled)."""
    source = _read_source(path)
    data = _run(state, lambda: core.create_script(actor_of(as_user), guild_id, name, source))
    emit(data, as_json, lambda d: d["logicScriptId"])


@script.command("update")
@click.argument("guild_id")
@click.argument("script_id")
@click.option("--file", "path", default=None, metavar="PATH")
@click.option("--name", default=None)
@as_option
@json_option
@pass_state
def script_update(state: State, guild_id: str, script_id: str, path: str | None,
                  name: str | None, as_user: str | None, as_json: bool) -> None:
    """Replace a script's source (new version) and/or rename it."""
    if path is None and name is None:
        raise click.UsageError("give --file and/or --name")
    source = _read_source(path) if path else None
    emit(_run(state, lambda: core.update_script(actor_of(as_user), guild_id, script_id,
                                                source, name)), as_json)


@script.command("show")
@click.argument("guild_id")
@click.argument("script_id")
@as_option
@json_option
@pass_state
def script_show(state: State, guild_id: str, script_id: str, as_user: str | None,
                as_json: bool) -> None:
    """Show a script with its source."""
    emit(_run(state, lambda: core.show_script(actor_of(as_user), guild_id, script_id)), as_json)


@script.command("delete")
@click.argument("guild_id")
@click.argument("script_id")
@as_option
@json_option
@pass_state
def script_delete(state: State, guild_id: str, script_id: str, as_user: str | None,
                  as_json: bool) -> None:
    """Delete a script (its ID stays reserved)."""
    emit(_run(state, lambda: core.delete_script(actor_of(as_user), guild_id, script_id)), as_json)


@script.command("list")
@click.argument("guild_id")
@as_option
@json_option
@pass_state
def script_list(state: State, guild_id: str, as_user: str | None, as_json: bool) -> None:
    """List a guild's scripts."""
    data = _run(state, lambda: core.list_scripts(actor_of(as_user), guild_id))
    emit(data, as_json, lambda d: "\n".join(
        f"{s['logicScriptId']}  {'on ' if s['endpointEnabled'] else 'off'}  v{s['version']}  {s['name']}"
        for s in d["scripts"]) or "(no scripts)")


# ------------------------------------------------------------- endpoint
@cli.group()
def endpoint() -> None:
    """Endpoints: switch on/off, show."""


def _endpoint_command(name: str, call: Any, doc: str) -> None:
    @endpoint.command(name, help=doc)
    @click.argument("guild_id")
    @click.argument("script_id")
    @as_option
    @json_option
    @pass_state
    def command(state: State, guild_id: str, script_id: str, as_user: str | None,
                as_json: bool) -> None:
        emit(_run(state, lambda: call(actor_of(as_user), guild_id, script_id,
                                      plans=state.settings.plans,
                                      base_url=state.settings.server.base_url)), as_json)


_endpoint_command("enable", core.enable_endpoint, "Switch the endpoint on (within the plan's quota).")
_endpoint_command("disable", core.disable_endpoint, "Switch the endpoint off.")
_endpoint_command("show", core.show_endpoint, "Show the endpoint: URL, switch, secret hint, whitelist.")


# --------------------------------------------------------------- secret
@cli.group()
def secret() -> None:
    """Endpoint secrets (owner only)."""


@secret.command("regenerate")
@click.argument("guild_id")
@click.argument("script_id")
@as_option
@json_option
@pass_state
def secret_regenerate(state: State, guild_id: str, script_id: str, as_user: str | None,
                      as_json: bool) -> None:
    """Create or replace the endpoint secret; it is shown only now."""
    data = _run(state, lambda: core.regenerate_secret(actor_of(as_user), guild_id, script_id))
    emit(data, as_json, lambda d: f"{d['secret']}\n(shown once; hint {d['hint']})")


# ------------------------------------------------------------ whitelist
@cli.group()
def whitelist() -> None:
    """IP whitelist (plans with IP whitelists)."""


@whitelist.command("set")
@click.argument("guild_id")
@click.argument("script_id")
@click.argument("cidrs", nargs=-1)
@as_option
@json_option
@pass_state
def whitelist_set(state: State, guild_id: str, script_id: str, cidrs: tuple[str, ...],
                  as_user: str | None, as_json: bool) -> None:
    """Replace the whitelist; no CIDR clears it."""
    emit(_run(state, lambda: core.set_whitelist(actor_of(as_user), guild_id, script_id, list(cidrs),
                                                plans=state.settings.plans,
                                                base_url=state.settings.server.base_url)), as_json)


# ---------------------------------------------------------------- reads
def _read_command(name: str, call: Any, doc: str) -> None:
    @cli.command(name, help=doc)
    @click.argument("guild_id")
    @click.argument("script_id")
    @as_option
    @json_option
    @pass_state
    def command(state: State, guild_id: str, script_id: str, as_user: str | None,
                as_json: bool) -> None:
        emit(_run(state, lambda: call(actor_of(as_user), guild_id, script_id,
                                      plans=state.settings.plans)), as_json, _summary)


def _summary(data: dict[str, Any]) -> str:
    import json
    return json.dumps(data, indent=2, sort_keys=True)


_read_command("history", core.history, "Show the request history, newest first.")
_read_command("errors", core.error_log, "Show the error log, newest first.")
_read_command("stats", core.stats, "Show request statistics.")


# ----------------------------------------------------------- operators
@cli.group()
def token() -> None:
    """Admin API tokens."""


@token.command("create")
@click.option("--user", "user_id", default=None, metavar="USER_ID", help="Token acting as this user.")
@click.option("--operator", is_flag=True, help="Operator token.")
@json_option
@pass_state
def token_create(state: State, user_id: str | None, operator: bool, as_json: bool) -> None:
    """Create an API token; it is printed only now."""
    if operator == (user_id is not None):
        raise click.UsageError("give exactly one of --user USER_ID or --operator")
    data = _run(state, lambda: core.create_api_token(core.Actor.operator(), user_id))
    emit(data, as_json, lambda d: d["token"])


@token.command("revoke")
@click.argument("token_id", type=int)
@json_option
@pass_state
def token_revoke(state: State, token_id: int, as_json: bool) -> None:
    """Revoke an API token by id."""
    def revoke() -> dict[str, Any]:
        core.revoke_api_token(core.Actor.operator(), token_id)
        return {}
    _run(state, revoke)
    emit({"id": token_id, "revoked": True}, as_json)


@cli.command("login-link")
@click.argument("user_id")
@json_option
@pass_state
def login_link(state: State, user_id: str, as_json: bool) -> None:
    """Print a one-time dashboard login link for a user."""
    data = _run(state, lambda: core.create_login_link(core.Actor.operator(), user_id,
                                                      state.settings.server.base_url))
    emit(data, as_json, lambda d: d["url"])


def _run(state: State, call: Any) -> dict[str, Any]:
    state.open_database()
    result: dict[str, Any] = call()
    return result
