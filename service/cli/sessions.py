"""`logic session`: the operator ends a user's dashboard sessions."""
from __future__ import annotations

from datetime import timedelta

import click

from service.cli.base import State, cli, emit, json_option, pass_state, run_core
from service.core import Actor
from service.core.sessions import end_user_sessions, live_sessions


@cli.group()
def session() -> None:
    """Dashboard sessions."""


@session.command("end")
@click.argument("user_id")
@json_option
@pass_state
def session_end(state: State, user_id: str, as_json: bool) -> None:
    """End every dashboard session of a user (they must log in again)."""
    data = run_core(state, lambda: {"userId": user_id,
                                    "ended": end_user_sessions(Actor.operator(), user_id)})
    emit(data, as_json, lambda d: f"ended {d['ended']} session(s) of user {d['userId']}")


@session.command("count")
@click.argument("user_id")
@json_option
@pass_state
def session_count(state: State, user_id: str, as_json: bool) -> None:
    """How many dashboard sessions of a user are live."""
    idle = timedelta(minutes=state.settings.dashboard.session_idle_minutes)
    data = run_core(state, lambda: {"userId": user_id,
                                    "live": live_sessions(Actor.operator(), user_id, idle=idle)})
    emit(data, as_json, lambda d: f"{d['live']} live session(s) of user {d['userId']}")
