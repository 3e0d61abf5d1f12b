"""`logic history`, `logic errors`, `logic stats`: what an endpoint's callers did."""
from __future__ import annotations

from typing import Any

import click

from service import core
from service.cli.base import State, actor_of, as_option, cli, emit, json_option, pass_state, run_core


def _read_command(name: str, call: Any, doc: str) -> None:
    @cli.command(name, help=doc)
    @click.argument("guild_id")
    @click.argument("script_id")
    @as_option
    @json_option
    @pass_state
    def command(state: State, guild_id: str, script_id: str, as_user: str | None,
                as_json: bool) -> None:
        emit(run_core(state, lambda: call(actor_of(as_user), guild_id, script_id,
                                      plans=state.settings.plans)), as_json, _summary)


def _summary(data: dict[str, Any]) -> str:
    import json
    return json.dumps(data, indent=2, sort_keys=True)


_read_command("history", core.history, "Show the request history, newest first.")
_read_command("errors", core.error_log, "Show the error log, newest first.")
_read_command("stats", core.stats, "Show request statistics.")
