"""`logic endpoint`, `logic secret`, `logic whitelist`: an endpoint's switch, secret and whitelist."""
from __future__ import annotations

from typing import Any

import click

from service import core
from service.cli.base import State, actor_of, as_option, cli, emit, json_option, pass_state, run_core


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
        emit(run_core(state, lambda: call(actor_of(as_user), guild_id, script_id,
                                      plans=state.settings.plans,
                                      base_url=state.settings.server.base_url)), as_json)


_endpoint_command("enable", core.enable_endpoint, "Switch the endpoint on (within the plan's quota).")
_endpoint_command("disable", core.disable_endpoint, "Switch the endpoint off.")
_endpoint_command("show", core.show_endpoint, "Show the endpoint: URL, switch, secret hint, whitelist.")


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
    data = run_core(state, lambda: core.regenerate_secret(actor_of(as_user), guild_id, script_id))
    emit(data, as_json, lambda d: f"{d['secret']}\n(shown once; hint {d['hint']})")


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
    emit(run_core(state, lambda: core.set_whitelist(actor_of(as_user), guild_id, script_id, list(cidrs),
                                                plans=state.settings.plans,
                                                base_url=state.settings.server.base_url)), as_json)
