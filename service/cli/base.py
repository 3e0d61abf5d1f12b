"""The `logic` group and what its commands share: `State`, options, `emit`, `main`.

A command parses arguments, builds the `Settings`, calls the service layer and
prints.  No rules of its own.

Output: human-readable lines, or with `--json` exactly one JSON object on
stdout.  Errors: one line on stderr, exit 2 (usage, bad input, not found),
3 (permission refused), 4 (quota or plan refused), 1 (anything else, e.g. a
database that is behind).  A command module attaches to `cli` (and is listed
in `service/cli/__init__.py`), e.g.:

    @cli.command()
    @click.option("--port", type=WholeNumber(), default=None)
    @pass_state
    def serve(state: State, port: int | None) -> None:
        state.overrides["server.port"] = port      # before the first state.settings
        settings = state.settings                   # file < env < flags, validated
        state.open_database()                       # refuses a database that is behind
        ...
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import tomllib
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import click

from service.cli.output import warn
from service.settings import Settings, SettingsError, load_settings

if TYPE_CHECKING:
    from service import core as core  # re-exported for the command modules
    from service.core.access import Actor
    from service.core.errors import CoreError
else:
    class _LazyModule(ModuleType):
        """`service.core`, imported on first use: `logic --help` and argument
        errors never load the models, peewee or the sandbox compiler
        (start-up time: bench/cli_startup.py)."""

        def __getattr__(self, name: str) -> Any:
            return getattr(importlib.import_module(self.__name__), name)

    core = _LazyModule("service.core")

EXIT_ERROR, EXIT_USAGE, EXIT_DENIED, EXIT_QUOTA = 1, 2, 3, 4


if TYPE_CHECKING:
    _IntParam = click.ParamType[int]      # generic from click 8.2 on
else:
    _IntParam = click.ParamType


class WholeNumber(_IntParam):
    """A whole number written in ASCII digits, optionally bounded.

    `type=int` would take whatever `int()` reads: other scripts' digits
    (`٨٠٨٠`), underscores (`80_80`), signs and surrounding spaces.  The
    digit rule is `service.core.inputs.ascii_digits`'s, written out here:
    importing it would load the service layer before any argument is read."""

    name = "integer"

    def __init__(self, low: int | None = None, high: int | None = None) -> None:
        self.low, self.high = low, high

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value)
        if not (0 < len(text) <= 18 and text.isascii() and text.isdigit()):
            self.fail(f"{text!r} is not a whole number in ASCII digits (0-9)", param, ctx)
        number = int(text)
        if self.low is not None and number < self.low:
            self.fail(f"{number} is below the least allowed, {self.low}", param, ctx)
        if self.high is not None and number > self.high:
            self.fail(f"{number} is above the most allowed, {self.high}", param, ctx)
        return number


class CommandError(Exception):
    """An error the CLI reports as one line with a given exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class State:
    """Per-invocation context: global options, then settings and the database."""

    database_url: str | None = None
    config: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    _settings: Settings | None = None

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            overrides = {"database.url": self.database_url, **self.overrides}
            try:
                self._settings = load_settings(self.config, os.environ, overrides)
            except SettingsError as err:
                raise CommandError(str(err), EXIT_USAGE) from None
        return self._settings

    def open_database(self, check_schema: bool = True, create: bool = False) -> None:
        """Connect the models; refuse a database that is behind. A SQLite file
        is made only with ``create`` (`logic db upgrade`, `logic demo`): any
        other command on a mistyped path says so and leaves no file behind."""
        from models.db import DatabaseURLError, connect
        from models.migrate import Runner, SchemaBehindError
        from service.core import secrets
        url = self.settings.database.url
        # The secrets' keyed verifier: `logic secret regenerate` stores one.
        secrets.configure(self.settings.server.cookie_secret)
        try:
            db = connect(url, create)
            db.connect(reuse_if_open=True)
            if check_schema:
                Runner(db).check()
        except DatabaseURLError as err:
            raise CommandError(str(err), EXIT_USAGE) from None
        except SchemaBehindError as err:
            raise CommandError(str(err), EXIT_ERROR) from None
        except Exception as err:  # driver errors: one line, never a traceback
            raise CommandError(cannot_open(url, err), EXIT_ERROR) from None


def cannot_open(url: str, err: BaseException) -> str:
    """A driver's error as one line, naming the database without its password."""
    from models.db import MissingDatabaseFile, describe_url
    if isinstance(err, MissingDatabaseFile):
        reason = str(err).rsplit(": ", 1)[-1]     # "<path>: <reason>"
        if reason == "no such database file":
            reason = 'no such file ("logic db upgrade" makes a new database there)'
        return f"cannot open database {describe_url(url)}: {reason}"
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return f"cannot open database {describe_url(url)}: {first}"


pass_state = click.make_pass_decorator(State)


def emit(data: dict[str, Any], as_json: bool, text: Callable[[dict[str, Any]], str] | None = None) -> None:
    """Print one JSON object, or a human-readable rendering (whose strings
    never carry a control character to the terminal: `output.printable`)."""
    if as_json:
        click.echo(json.dumps(data, sort_keys=True))   # ASCII: every control escaped
        return
    from service.cli.output import fields, local_time, printable
    data = printable(data)
    if text is not None:
        click.echo(text(data))
    else:
        pairs = []
        for key, value in data.items():
            if isinstance(value, list) and all(isinstance(v, (str, int)) for v in value):
                shown: Any = ", ".join(str(v) for v in value) or "-"
            elif isinstance(value, (dict, list)):
                shown = json.dumps(value)
            elif key.endswith("At") and isinstance(value, str):
                shown = local_time(value)
            else:
                shown = value
            pairs.append((key, shown))
        click.echo(fields(pairs))


def actor_of(as_user: str | None) -> Actor:
    """`--as USER_ID`, or the operator."""
    return core.Actor.operator() if as_user is None else core.Actor.user(as_user)


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
as_option = click.option("--as", "as_user", metavar="USER_ID", default=None,
                         help="Act as this user (default: the operator).")


def run_core(state: State, call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Open the database (checking the schema) and run a service-layer call."""
    state.open_database()
    return call()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--database-url", metavar="URL", default=None,
              help="Database URL (env LOGIC_DATABASE_URL; default sqlite:///logic.db).")
@click.option("--config", metavar="FILE", default=None, type=click.Path(dir_okay=False),
              help="TOML configuration file (env LOGIC_CONFIG).")
@click.version_option(package_name="logic-endpoints", prog_name="logic")
@click.pass_context
def cli(ctx: click.Context, database_url: str | None, config: str | None) -> None:
    """Logic Endpoints: inbound HTTP endpoints for guild scripts."""
    # Env and file precedence is handled by load_settings, so these options
    # have no click-level default that would override the config file.
    ctx.obj = State(database_url=database_url, config=config)


def _exit_code(err: CoreError) -> int:
    if isinstance(err, core.PermissionDeniedError):
        return EXIT_DENIED
    if isinstance(err, core.QuotaError):
        return EXIT_QUOTA
    if isinstance(err, (core.NotFoundError, core.ValidationError)):
        return EXIT_USAGE
    return EXIT_ERROR


def _core_error(err: Exception) -> CoreError | None:
    """`err` when it is a service-layer error (only looked at once something failed)."""
    if "service.core" not in sys.modules:
        return None
    return err if isinstance(err, core.CoreError) else None


def _fail(message: str, code: int) -> NoReturn:
    from service.cli.output import printable
    click.echo(f"logic: error: {printable(' '.join(message.split()))}", err=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: one-line errors with stable exit codes."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cli.main(args=argv, prog_name="logic", standalone_mode=False)
    except click.UsageError as err:
        if type(err).__name__ == "NoArgsIsHelpError":   # click >= 8.2: bare group
            click.echo(err.ctx.get_help() if err.ctx else err.format_message())
            sys.exit(EXIT_USAGE)
        _fail(err.format_message(), EXIT_USAGE)
    except click.ClickException as err:
        _fail(err.format_message(), err.exit_code or EXIT_ERROR)
    except click.exceptions.Abort:
        _fail("aborted", EXIT_ERROR)
    except click.exceptions.Exit as err:
        sys.exit(err.exit_code)
    except CommandError as err:
        _fail(str(err), err.exit_code)
    except SettingsError as err:
        _fail(str(err), EXIT_USAGE)
    except Exception as err:
        found = _core_error(err)
        if found is not None:
            _fail(found.message, _exit_code(found))
        said = _database_error(err)
        if said is not None:
            _fail(f"the database refused the command: {said}", EXIT_ERROR)
        if isinstance(err, OSError) and err.filename is None:
            # Writing our own output failed (a full disk, a closed pipe): what
            # the command changed may be in effect though nothing was shown.
            _fail(f"could not write the output ({err.strerror or type(err).__name__}); the "
                  "command may have completed: check with a read command", EXIT_ERROR)
        raise


def _database_error(err: BaseException) -> str | None:
    """The first line of a database error's own message (SQLite's "database is
    locked", a PostgreSQL server's reason), at most 200 characters; None when
    `err` is not one. Only a line: a driver's later lines may quote the query."""
    if "peewee" not in sys.modules:
        return None
    import peewee
    if not isinstance(err, peewee.DatabaseError):
        return None
    text = str(err).strip().split("\n", 1)[0] or type(err).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _base_url_configured(state: State) -> bool:
    """Whether the operator set server.base_url (environment or configuration file)."""
    if os.environ.get("LOGIC_SERVER_BASE_URL"):
        return True
    path = state.config or os.environ.get("LOGIC_CONFIG")
    if not path:
        return False
    try:
        with open(path, "rb") as f:
            server = tomllib.load(f).get("server", {})
    except (OSError, tomllib.TOMLDecodeError):
        return False        # the settings loader already reported a bad file
    return isinstance(server, dict) and "base_url" in server


def base_url_warning(state: State) -> None:
    """`logic: warning: ...` when a printed URL is built from a base URL never configured."""
    server = state.settings.server
    if not _base_url_configured(state):
        warn(f"server.base_url is not configured, so this URL uses {server.base_url}; set it "
             "(config [server] base_url or LOGIC_SERVER_BASE_URL) to the address clients reach")
