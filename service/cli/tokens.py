"""`logic token` and `logic login-link`: credentials for the admin API and the dashboard."""
from __future__ import annotations

from typing import Any

import click

from service.cli.base import (core, State, base_url_warning, cli, emit, json_option, pass_state,
                              run_core)


@cli.group()
def token() -> None:
    """Admin API tokens."""


@token.command("create")
@click.option("--user", "user_id", default=None, metavar="USER_ID", help="Token acting as this user.")
@click.option("--operator", is_flag=True, help="Operator token.")
@json_option
@pass_state
def token_create(state: State, user_id: str | None, operator: bool, as_json: bool) -> None:
    """Create an API token; it is printed only now (its id, to revoke it, on stderr)."""
    if operator == (user_id is not None):
        raise click.UsageError("give exactly one of --user USER_ID or --operator")
    data = run_core(state, lambda: core.create_api_token(core.Actor.operator(), user_id))
    if not as_json:
        # stdout stays the token alone (`TOKEN=$(logic token create ...)`).
        click.echo(f"token id {data['id']}: revoke it with `logic token revoke {data['id']}`",
                   err=True)
    emit(data, as_json, lambda d: d["token"])


@token.command("revoke")
@click.argument("token_id")
@json_option
@pass_state
def token_revoke(state: State, token_id: str, as_json: bool) -> None:
    """Revoke an API token by id."""
    def revoke() -> dict[str, Any]:
        return {"id": core.revoke_api_token(core.Actor.operator(), token_id), "revoked": True}
    emit(run_core(state, revoke), as_json)


@cli.command("login-link")
@click.argument("user_id")
@json_option
@pass_state
def login_link(state: State, user_id: str, as_json: bool) -> None:
    """Print a one-time dashboard login link for a user."""
    data = run_core(state, lambda: core.create_login_link(core.Actor.operator(), user_id,
                                                      state.settings.server.base_url))
    base_url_warning(state)
    emit(data, as_json, lambda d: d["url"])
