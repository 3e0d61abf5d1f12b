"""`logic serve` and `logic demo`: run the HTTP service (thin; see `service.http.server`)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click

from service.cli.base import (EXIT_ERROR, EXIT_USAGE, CommandError, State, WholeNumber,
                              cannot_open, cli, pass_state)


def _configure_logging() -> None:
    from service.http.redaction import RedactingFormatter

    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for handler in root.handlers:
        # Never a secret-shaped word in the log, tracebacks included (service.http.redaction).
        handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # Per-request lines go to "logic.access" at DEBUG (see service.http.app.log_request):
    # not shown at INFO, so a flood of bad requests cannot fill the disk.


F = TypeVar("F", bound=Callable[..., Any])


def _serve_options(func: F) -> F:
    func = click.option("--processes", default=None, metavar="N|auto",
                        help="Front processes sharing the port (default: config, else 1; "
                             "auto = CPU count).")(func)
    func = click.option("--workers", type=WholeNumber(1), default=None,
                        help="Sandbox worker processes, 1 or more (default: config, else CPU "
                             "count).")(func)
    func = click.option("--port", type=WholeNumber(0, 65535), default=None, help="Port, 0-65535 (default 8080).")(func)
    func = click.option("--host", default=None, help="Address to bind (default 127.0.0.1).")(func)
    return func


def _apply(state: State, host: str | None, port: int | None, workers: int | None,
           processes: str | None) -> None:
    state.overrides.update({"server.host": host, "server.port": port, "sandbox.workers": workers,
                            "server.processes": processes})


def _run_dir(processes: int) -> str | None:
    """Several fronts: their run directory, made before the service is imported
    (prometheus-client reads PROMETHEUS_MULTIPROC_DIR when it is imported)."""
    if processes < 2:
        return None
    from service.http.run_dir import make_run_dir

    return make_run_dir()


NO_COOKIE_SECRET = ("server.cookie_secret is not set: the dashboard signs its sessions with it; "
                    "set it in the configuration file or LOGIC_SERVER_COOKIE_SECRET (at least "
                    "32 random characters)")


def _reloader(state: State) -> Callable[[], Any]:
    """Re-reads the configuration file and the environment with the same flags (SIGHUP),
    and refuses (`SettingsError`: the running fronts stay) what `serve` refuses at start:
    no cookie secret, a database that cannot be opened or is not at this release's
    schema (review, session 27: a reload without the cookie secret signed sessions with
    an empty key, and one to an empty database file answered 500 while ready)."""
    def reload() -> Any:
        from models.db import open_database
        from models.migrate import Runner, SchemaBehindError
        from service.settings import SettingsError, load_settings

        overrides = {"database.url": state.database_url, **state.overrides}
        fresh = load_settings(state.config, os.environ, overrides)
        if not fresh.server.cookie_secret:
            raise SettingsError(NO_COOKIE_SECRET)
        url = fresh.database.url
        try:
            db = open_database(url, create=False)
            try:
                db.connect(reuse_if_open=True)
                Runner(db).check()
            finally:
                db.close()
        except SchemaBehindError as err:
            raise SettingsError(str(err)) from None
        except Exception as err:  # driver errors: one line, never a traceback
            raise SettingsError(cannot_open(url, err)) from None
        return fresh
    return reload


@cli.command()
@_serve_options
@pass_state
def serve(state: State, host: str | None, port: int | None, workers: int | None,
          processes: str | None) -> None:
    """Serve the invoke endpoint and health checks until SIGTERM/SIGINT."""
    _apply(state, host, port, workers, processes)
    settings = state.settings
    if not settings.server.cookie_secret:
        raise CommandError(NO_COOKIE_SECRET, EXIT_USAGE)
    state.open_database()  # refuses a database that is behind, with one line
    _configure_logging()
    run_dir = _run_dir(settings.server.process_count)
    from service.http.server import serve as run

    with _serve_errors(settings):
        run(settings, reload=_reloader(state), run_dir=run_dir)


@contextlib.contextmanager
def _serve_errors(settings: Any) -> Iterator[None]:
    """What keeps a start from serving, as one line: the journal (named), the address."""
    from service.http.arbiter import FrontStartError
    from service.http.journal import JournalInUse, JournalUnusable

    try:
        yield
    except JournalUnusable as err:
        raise CommandError(str(err), EXIT_USAGE) from None
    except JournalInUse as err:
        raise CommandError(str(err), EXIT_ERROR) from None
    except OSError as err:
        where = f"{settings.server.host}:{settings.server.port}"
        raise CommandError(f"cannot serve on {where}: {err.strerror or err}", EXIT_ERROR) from None
    except FrontStartError as err:
        raise CommandError(str(err), EXIT_ERROR) from None


def _can_serve(settings: Any) -> None:
    """Raise what would keep `serve` from starting, before anything is changed: the
    address in use, the journal another process holds (review, session 27: a second
    `logic demo` made a new secret, so the first one's printed curl line got 401,
    and only then failed)."""
    from service.http.journal import Journal
    from service.http.ports import refuse_a_port_in_use
    from service.http.server import journal_path
    refuse_a_port_in_use(settings.server.host, settings.server.port)
    if settings.records.journal != "off":
        Journal(journal_path(settings)).close()


@cli.command()
@_serve_options
@pass_state
def demo(state: State, host: str | None, port: int | None, workers: int | None,
         processes: str | None) -> None:
    """Create a demo guild, script and endpoint; print its URL, secret and a curl line; serve."""
    from service.cli.demo import setup_demo, with_cookie_secret
    from service.http.server import serve as run

    _apply(state, host, port, workers, processes)
    settings = with_cookie_secret(state.settings)
    state.open_database(check_schema=False, create=True)
    with _serve_errors(settings):
        _can_serve(settings)
    info = setup_demo(settings)
    click.echo(f"Demo endpoint: {info.url}")
    click.echo(f"Secret (shown once, keep it safe): {info.secret}")
    click.echo("Try it:")
    click.echo(f"  {info.curl}")
    click.echo(f"Dashboard (one-time login link for the demo owner): {info.login_url}")
    click.echo("Stop with Ctrl-C.")
    _configure_logging()
    with _serve_errors(settings):
        run(settings, run_dir=_run_dir(settings.server.process_count))
