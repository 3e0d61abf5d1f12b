"""`logic endpoint`, `logic secret`, `logic whitelist`: an endpoint's switch, secret and whitelist."""
from __future__ import annotations

from typing import Any

import click

from service.cli.base import (core, State, actor_of, as_option, base_url_warning, cli, emit,
                              json_option, pass_state, run_core)
from service.cli.output import fields, local_time


@cli.group()
def endpoint() -> None:
    """Endpoints: switch on/off, show."""


def _endpoint_command(name: str, function: str, doc: str) -> None:
    @endpoint.command(name, help=doc)
    @click.argument("guild_id")
    @click.argument("script_id")
    @as_option
    @json_option
    @pass_state
    def command(state: State, guild_id: str, script_id: str, as_user: str | None,
                as_json: bool) -> None:
        call = getattr(core, function)
        data = run_core(state, lambda: call(actor_of(as_user), guild_id, script_id,
                                            plans=state.settings.plans,
                                            base_url=state.settings.server.base_url))
        base_url_warning(state)
        _emit_endpoint(state, as_user, data, as_json)


def _emit_endpoint(state: State, as_user: str | None, data: dict[str, Any], as_json: bool) -> None:
    owner = None if as_json or data["secret"] else _owner(state, as_user, data["guildId"])
    emit(data, as_json, lambda d: _endpoint_text(d, owner))


def _owner(state: State, as_user: str | None, guild_id: str) -> str:
    """The guild owner's id, for a command line that can be run as it is."""
    guild = run_core(state, lambda: core.show_guild(actor_of(as_user), guild_id,
                                                    plans=state.settings.plans))
    return str(guild["ownerId"])


def _endpoint_text(d: dict[str, Any], owner: str | None) -> str:
    secret = d["secret"]
    state = "on" if d["enabled"] else "off"
    if d["enabled"] and not d["active"]:
        state = f"on, but plan {d['plan']} allows no endpoints (not answering)"
    wl = ", ".join(d["whitelist"]) or "(none: any IP)"
    if d["whitelist"] and not d["whitelistEnforced"]:
        wl += f"  (kept, not enforced: plan {d['plan']} has no IP whitelist)"
    lines = fields([
        ("url", d.get("url")), ("enabled", state), ("plan", d["plan"]),
        ("secret", f"…{secret['hint']} (created {local_time(secret['createdAt'])} by "
                   f"{secret['createdBy']})" if secret else "none yet"),
        ("whitelist", wl)])
    steps = []
    gid, sid = d["guildId"], d["logicScriptId"]
    if secret is None:
        steps.append("the guild owner creates the secret (shown once):\n"
                     f"  logic secret regenerate {gid} {sid} --as {owner or 'OWNER_ID'}")
    if not d["enabled"]:
        steps.append(f"switch it on:\n  logic endpoint enable {gid} {sid}")
    if d["enabled"] and secret is not None and d["active"]:
        steps.append("clients POST to the URL with Authorization: Bearer <secret>")
    return lines + ("\n\nnext:\n" + "\n".join("- " + s for s in steps) if steps else "")


# By name: `core` is loaded only when a command runs.
_endpoint_command("enable", "enable_endpoint", "Switch the endpoint on (within the plan's quota).")
_endpoint_command("disable", "disable_endpoint", "Switch the endpoint off.")
_endpoint_command("show", "show_endpoint", "Show the endpoint: URL, switch, secret hint, whitelist.")


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
    def regenerate() -> dict[str, Any]:
        try:
            return core.regenerate_secret(actor_of(as_user), guild_id, script_id)
        except core.PermissionDeniedError as err:
            if err.code != "owner_only" or as_user is not None:
                raise
            owner = _owner(state, None, guild_id)
            raise core.PermissionDeniedError(err.message + f" (run it with --as {owner})",
                                             code="owner_only") from None
    data = run_core(state, regenerate)
    emit(data, as_json, lambda d: f"{d['secret']}\n(shown once; hint {d['hint']}; clients send it as "
                                  "Authorization: Bearer <secret>)")


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
    data = run_core(state, lambda: core.set_whitelist(actor_of(as_user), guild_id, script_id, list(cidrs),
                                                      plans=state.settings.plans,
                                                      base_url=state.settings.server.base_url))
    _emit_endpoint(state, as_user, data, as_json)
