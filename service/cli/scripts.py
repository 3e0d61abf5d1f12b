"""`logic script`: create, update, show, delete and list scripts."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from service import core
from service.cli.base import EXIT_USAGE, CommandError, State, actor_of, as_option, cli, emit, json_option, pass_state, run_core


def _read_source(path: str) -> bytes:
    if path == "-":                       # --file - : read the script from stdin
        return sys.stdin.buffer.read()
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise CommandError(f"cannot read {path}: {err.strerror}", EXIT_USAGE) from None



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
    data = run_core(state, lambda: core.create_script(actor_of(as_user), guild_id, name, source))
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
    emit(run_core(state, lambda: core.update_script(actor_of(as_user), guild_id, script_id,
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
    emit(run_core(state, lambda: core.show_script(actor_of(as_user), guild_id, script_id)), as_json)


@script.command("delete")
@click.argument("guild_id")
@click.argument("script_id")
@as_option
@json_option
@pass_state
def script_delete(state: State, guild_id: str, script_id: str, as_user: str | None,
                  as_json: bool) -> None:
    """Delete a script (its ID stays reserved)."""
    emit(run_core(state, lambda: core.delete_script(actor_of(as_user), guild_id, script_id)), as_json)


@script.command("list")
@click.argument("guild_id")
@as_option
@json_option
@pass_state
def script_list(state: State, guild_id: str, as_user: str | None, as_json: bool) -> None:
    """List a guild's scripts."""
    data = run_core(state, lambda: core.list_scripts(actor_of(as_user), guild_id))
    emit(data, as_json, lambda d: "\n".join(
        f"{s['logicScriptId']}  {'on ' if s['endpointEnabled'] else 'off'}  v{s['version']}  {s['name']}"
        for s in d["scripts"]) or "(no scripts)")
