"""`logic db`: the database schema (upgrade, version)."""
from __future__ import annotations

from service.cli.base import EXIT_ERROR, CommandError, State, cli, emit, json_option, pass_state


@cli.group()
def db() -> None:
    """Database schema."""


@db.command("upgrade")
@json_option
@pass_state
def db_upgrade(state: State, as_json: bool) -> None:
    """Bring the database to this release's schema (idempotent)."""
    from models.db import database
    from models.migrate import Runner, SchemaBehindError
    state.open_database(check_schema=False, create=True)
    runner = Runner(database.obj)
    before = runner.current_version()
    if before > runner.latest:
        # Not "current": a start-up check (ExecStartPre) must not pass on a
        # database this release cannot serve (review, session 27).
        raise CommandError(str(SchemaBehindError(before, runner.latest)), EXIT_ERROR)
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


@db.command("new-installation-id")
@json_option
@pass_state
def db_new_installation_id(state: State, as_json: bool) -> None:
    """Give this database a new installation id (a restored copy run as a second
    installation: its rate limits in a shared Redis then keep apart)."""
    from models.installation import renew_installation_id
    state.open_database()
    emit({"installation": renew_installation_id()}, as_json,
         lambda d: f"installation id is now {d['installation']} (restart the nodes that use it)")
