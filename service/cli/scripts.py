"""`logic script`: create, update, check, show, delete, list, versions and rollback."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from service.cli.base import (core, EXIT_USAGE, CommandError, State, actor_of, as_option, cli, emit,
                              json_option, pass_state, run_core, WholeNumber)
from service.cli.output import local_time, table, warn


def _read_source(path: str) -> bytes:
    if path == "-":                       # --file - : read the script from stdin
        return sys.stdin.buffer.read()
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise CommandError(f"cannot read {path}: {err.strerror}", EXIT_USAGE) from None


def _warnings(data: dict[str, Any]) -> None:
    """Save-time warnings go to stderr, so stdout stays the ID or the JSON."""
    for w in data.get("warnings", []):
        warn(f"{w['line']}:{w['column']}: {w['message']}")


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
    data = run_core(state, lambda: core.create_script(actor_of(as_user), guild_id, name, source,
                                                      plans=state.settings.plans))
    _warnings(data)
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
    data = run_core(state, lambda: core.update_script(actor_of(as_user), guild_id, script_id,
                                                      source, name, plans=state.settings.plans))
    _warnings(data)
    emit(data, as_json, lambda d: f"{d['logicScriptId']} is now version {d['version']} ({d['name']})")


@script.command("check")
@click.argument("path", metavar="FILE")
@json_option
def script_check(path: str, as_json: bool) -> None:
    """Run the save-time checks on FILE (or - for stdin) without saving it."""
    data = core.check_source(_read_source(path))
    _warnings(data)
    emit(data, as_json, lambda d: f"{path}: ok" + (f" ({len(d['warnings'])} warning(s))"
                                                    if d["warnings"] else ""))


@script.command("versions")
@click.argument("guild_id")
@click.argument("script_id")
@as_option
@json_option
@pass_state
def script_versions(state: State, guild_id: str, script_id: str, as_user: str | None,
                    as_json: bool) -> None:
    """List a script's kept versions, newest first."""
    data = run_core(state, lambda: core.list_versions(actor_of(as_user), guild_id, script_id,
                                                      plans=state.settings.plans))
    emit(data, as_json, lambda d: table(
        ("VERSION", "SAVED", "AUTHOR", "SIZE"),
        [(f"{v['version']}{' (current)' if v['version'] == d['current'] else ''}",
          local_time(v["time"]), v["author"], f"{v['sourceBytes']} B") for v in d["versions"]],
        empty="(no versions kept)") + f"\n(the newest {d['kept']} versions are kept)")


@script.command("rollback", context_settings={"ignore_unknown_options": True})
@click.argument("guild_id")
@click.argument("script_id")
@click.argument("version", type=WholeNumber())
@as_option
@json_option
@pass_state
def script_rollback(state: State, guild_id: str, script_id: str, version: int,
                    as_user: str | None, as_json: bool) -> None:
    """Restore VERSION's source as a new version."""
    data = run_core(state, lambda: core.rollback(actor_of(as_user), guild_id, script_id, version,
                                                 plans=state.settings.plans))
    _warnings(data)
    emit(data, as_json, lambda d: f"{d['logicScriptId']} is now version {d['version']}, "
                                  f"with the source of version {version}")


@script.command("show")
@click.argument("guild_id")
@click.argument("script_id")
@as_option
@json_option
@pass_state
def script_show(state: State, guild_id: str, script_id: str, as_user: str | None,
                as_json: bool) -> None:
    """Show a script with its source."""
    emit(run_core(state, lambda: core.show_script(actor_of(as_user), guild_id, script_id)), as_json,
         _script_text)


def _script_text(d: dict[str, Any]) -> str:
    head = (f"{d['name']}  {d['logicScriptId']}  version {d['version']}  "
            f"endpoint {'on' if d['endpointEnabled'] else 'off'}  updated {local_time(d['updatedAt'])}")
    notes = [f"warning {w['line']}:{w['column']}: {w['message']}" for w in d.get("warnings", [])]
    return "\n".join([head, *notes, "", d["source"].rstrip("\n")])


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
    emit(data, as_json, lambda d: table(
        ("ID", "NAME", "VERSION", "ENDPOINT", "UPDATED"),
        [(s["logicScriptId"], s["name"], s["version"],
          click.style("on", fg="green") if s["endpointEnabled"] else "off", local_time(s["updatedAt"]))
         for s in d["scripts"]], empty="(no scripts)"))
