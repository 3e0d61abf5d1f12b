"""Database handle: one `DatabaseProxy` every model binds to, and `connect(url)`.

One URL picks the backend (as `playhouse.db_url` does):
- `sqlite:///relative/path.db`, `sqlite:////abs/path.db`, `sqlite:///:memory:`:
  WAL journal, foreign keys on, a busy timeout, and `BEGIN IMMEDIATE` for every
  transaction so two writers queue instead of failing half-way through a
  read-then-write (quota checks read, then write);
- `postgresql://user:pass@host:port/dbname?options=...`: psycopg2; query
  parameters are passed to `psycopg2.connect` (e.g. `connect_timeout`,
  `sslmode`, `options=-c search_path=...`).

Threads: peewee keeps one connection per thread (`thread_safe=True`), so a
thread pool gets one connection per worker thread, opened on first use and
reused.  `close()` closes the calling thread's connection.  A PostgreSQL
connection the server dropped is reopened on the next statement outside a
transaction (see `ReconnectingPostgresqlDatabase`), except a statement given
up on (`models.db_watched`).
"""
from __future__ import annotations

import logging
import os
import sqlite3
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlparse, urlsplit

from peewee import (Database, DatabaseProxy, InterfaceError, Model, OperationalError,
                    PostgresqlDatabase, SqliteDatabase)
from playhouse.shortcuts import ReconnectMixin  # type: ignore[import-untyped]

from models.db_watched import WatchedMixin

# peewee logs every query WITH its parameters at DEBUG: script source, request
# bodies and hashes would reach the logs of an operator who turns on DEBUG.
# Never log user source or secrets, so its query log stays off.
logging.getLogger("peewee").setLevel(logging.INFO)

#: The proxy every model binds to; `connect()` points it at a real database.
database = DatabaseProxy()

#: Milliseconds a SQLite writer waits for the lock before failing.
SQLITE_BUSY_TIMEOUT_S = 10.0


class MissingDatabaseFile(OperationalError):
    """A SQLite database opened to be used, not made, whose file is not there
    (a mistyped path), or no longer the file this process opened (removed, or
    another file moved over it while the service ran)."""


#: Statements that write nothing to the database file (their first word; a
#: PRAGMA only when it sets nothing and calls nothing: `_writes`).
_READS = ("SELECT", "PRAGMA", "BEGIN", "ROLLBACK", "SAVEPOIN", "EXPLAIN")


def _writes(sql: str) -> bool:
    """Whether `sql` may write to the database file (anything not known to be a read)."""
    head = sql.lstrip()[:8].upper()
    if not head.startswith(_READS):
        return True
    # `PRAGMA user_version = 7`, `PRAGMA wal_checkpoint(TRUNCATE)` write.
    return head.startswith("PRAGMA") and ("=" in sql or "(" in sql)


class _PrivateSqlite(SqliteDatabase):
    """A SQLite database whose file, when this creates it, only its owner can
    read (mode 0600; SQLite gives its -wal and -shm files the same mode): it
    holds secrets' verifiers, API token hashes and request history. A file
    that already exists keeps the mode the operator gave it.

    Opened with ``create=False``, a missing file is `MissingDatabaseFile`
    instead of a new empty database (the file is opened with SQLite's
    ``mode=rw``, so not even a file removed between the check and the open
    is made again): a mistyped path must not start a service that answers
    every endpoint "not found", nor leave an empty file behind.

    The first connection records the file's identity (or ``identity`` gives
    it: another process's, the service's reading processes); a later
    connection to a path that now holds another file, or none, is refused:
    it would open that file with the WAL the old file's connections still
    write (`<path>-wal` is found by name), which corrupts it."""

    def __init__(self, path: str, create: bool = True,
                 identity: tuple[int, int] | None = None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.create = create
        #: (device, inode) of the file the first connection opened.
        self.identity: tuple[int, int] | None = identity

    def _is_file(self) -> bool:
        path = self.database
        return bool(path) and path != ":memory:"

    def file_replaced(self) -> bool:
        """Whether the file at the path is gone, or is another file than the
        one the first connection opened."""
        if self.identity is None or not self._is_file():
            return False
        try:
            st = os.stat(self.database)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self.identity

    def connect(self, reuse_if_open: bool = False) -> bool:
        # Here, not in `_connect`: peewee maps what `_connect` raises onto its
        # own classes by name, which would lose this one's.
        if self.is_closed() and self._is_file():
            self._refuse_a_gone_file()
        return bool(super().connect(reuse_if_open))

    def _refuse_a_gone_file(self) -> None:
        path = self.database
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if self.create:
                return
            folder = os.path.dirname(path) or "."
            if self.identity is None and not os.path.isdir(folder):
                raise MissingDatabaseFile(f"{path}: no such directory {folder}") from None
            raise MissingDatabaseFile(
                f"{path}: no such database file" if self.identity is None
                else f"{path}: the database file was removed while the service ran") from None
        except OSError:
            return   # a permission or a path problem: SQLite says which
        if self.identity is not None and (st.st_dev, st.st_ino) != self.identity:
            raise MissingDatabaseFile(f"{path}: another file was put in place of the database "
                                      "while the service ran")

    def execute_sql(self, sql: str, params: Any = None) -> Any:
        # A write through a connection opened before the file was replaced
        # lands in `<path>-wal`, found by name, which SQLite would then read
        # with the file now at the path: corrupted (review, session 28). One
        # `stat` per write statement; reads go on from the old file.
        if self.identity is not None and _writes(sql):
            self._refuse_a_replaced_file()
        return super().execute_sql(sql, params)  # type: ignore[no-untyped-call]

    def commit(self) -> None:
        if self.identity is not None and self.file_replaced():
            self.rollback()
            self._refuse_a_replaced_file()
        super().commit()

    def _refuse_a_replaced_file(self) -> None:
        if self.file_replaced():
            raise MissingDatabaseFile(f"{self.database}: the database file was removed or "
                                      "replaced while the service ran; nothing is written to it")

    def _connect(self) -> Any:
        if not self._is_file():
            return super()._connect()  # type: ignore[misc]
        if self.create:
            try:
                os.close(os.open(self.database, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except OSError:   # it exists, or cannot be made: SQLite says which
                pass
            conn = super()._connect()  # type: ignore[misc]
        else:
            # mode=rw: never made, even if removed since the check in `connect`.
            uri = "file:" + quote(os.path.abspath(self.database)) + "?mode=rw"
            conn = sqlite3.connect(uri, uri=True, timeout=self._timeout,  # type: ignore[attr-defined]
                                   isolation_level=None,
                                   **self.connect_params)
            try:
                self._add_conn_hooks(conn)  # type: ignore[attr-defined]
            except Exception:
                conn.close()
                raise
        if self.identity is None:
            try:
                st = os.stat(self.database)
                self.identity = (st.st_dev, st.st_ino)
            except OSError:
                pass
        return conn


class BaseModel(Model):
    """Shared base: binds to the proxy; table names are snake_case."""

    class Meta:
        database = database
        legacy_table_names = False


class ReconnectingPostgresqlDatabase(WatchedMixin, ReconnectMixin,  # type: ignore[misc]
                                     PostgresqlDatabase):
    """PostgreSQL that reopens a connection the server dropped (restart,
    failover, idle timeout).  The mixin never retries inside a transaction,
    and every write here runs in one, so a retried statement is a read or a
    BEGIN: nothing is applied twice.

    A thread that runs its statements under a `StatementWatch` (`watching`,
    `models.db_watched`) tells it each statement's connection and span, and
    a statement the watch gave up on is never retried: its connection ends
    with it."""

    #: Connection parameters the URL's query string set (`open_database`).
    url_params: frozenset[str] = frozenset()

    reconnect_errors = (
        (OperationalError, "server closed the connection"),
        (OperationalError, "terminating connection"),
        (OperationalError, "could not receive data from server"),
        (InterfaceError, "connection already closed"),
    )


class DatabaseURLError(ValueError):
    """The database URL cannot be used; the message names the problem."""


def _qs_value(value: str) -> Any:
    return int(value) if value.isdigit() else value


def describe_url(url: str) -> str:
    """A database URL to name in a message: the SQLite path, or the server and
    database without the password."""
    if url.startswith("sqlite:///"):
        return url[len("sqlite:///"):] or url
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        user = f"{parts.username}@" if parts.username else ""
    except ValueError:
        return "(unparseable URL)"
    if not parts.scheme:
        return "(no scheme)"
    return f"{parts.scheme}://{user}{host}{port}{parts.path}"


def open_database(url: str, create: bool = True,
                  identity: tuple[int, int] | None = None) -> Database:
    """Return an unconnected peewee `Database` for `url` (no proxy change).
    A `DatabaseURLError`'s message never holds the URL's password. With
    ``create=False`` a SQLite file that does not exist is not made: connecting
    raises `MissingDatabaseFile`; ``identity``: the SQLite file's (device,
    inode) as another process opened it, for `file_replaced`."""
    try:
        parsed = urlparse(url)
    except ValueError:   # its text quotes what it choked on: maybe the password
        raise DatabaseURLError("database url (unparseable URL): percent-encode / ? # @ : [ ] "
                               "in the user name and password") from None
    params = {k: _qs_value(v) for k, v in parse_qsl(parsed.query, keep_blank_values=True)}
    if parsed.scheme == "sqlite":
        path = unquote(parsed.path[1:]) if parsed.path.startswith("/") else parsed.path
        if not path:
            raise DatabaseURLError(f"database url {describe_url(url)!r}: missing file path (sqlite:///logic.db)")
        if path.startswith("file:"):
            # SQLite would read it as a URI of its own, with its own modes.
            raise DatabaseURLError(f"database url {describe_url(url)!r}: give the file's path "
                                   "(sqlite:///logic.db), not a file: URI")
        return _PrivateSqlite(
            path,
            create=create,
            identity=identity,
            pragmas={
                "journal_mode": "wal",
                "foreign_keys": 1,
                "busy_timeout": int(SQLITE_BUSY_TIMEOUT_S * 1000),
                # WAL makes NORMAL durable against application crashes; only
                # an OS crash can lose the last transactions.
                "synchronous": "normal",
            },
            timeout=SQLITE_BUSY_TIMEOUT_S,
            lock_type="IMMEDIATE",
        )
    if parsed.scheme in ("postgres", "postgresql"):
        kwargs: dict[str, Any] = dict(params)
        # Bounded: the invoke path reads on the event loop, which must not wait
        # for a TCP timeout when the server is gone (override with ?connect_timeout=N).
        kwargs.setdefault("connect_timeout", 5)
        # A network that went silent surfaces as an error within ~10 s, not
        # when TCP gives up after many minutes (override each in the URL).
        kwargs.setdefault("keepalives", 1)
        kwargs.setdefault("keepalives_idle", 5)
        kwargs.setdefault("keepalives_interval", 2)
        kwargs.setdefault("keepalives_count", 3)
        kwargs.setdefault("tcp_user_timeout", 10000)
        if parsed.username:
            kwargs["user"] = unquote(parsed.username)
        if parsed.password:
            kwargs["password"] = unquote(parsed.password)
        if parsed.hostname:
            kwargs["host"] = parsed.hostname
        try:
            port = parsed.port
        except ValueError:
            # Its text would quote what stands where the port goes: with a
            # `/`, `?` or `#` in the password, part of the password.
            raise DatabaseURLError(
                f"database url {describe_url(url)!r}: the port is not a number (percent-encode "
                "/ ? # @ : in the user name and password)") from None
        if port:
            kwargs["port"] = port
        name = unquote(parsed.path[1:])
        if not name:
            raise DatabaseURLError(f"database url {describe_url(url)!r}: missing database name")
        db = ReconnectingPostgresqlDatabase(name, **kwargs)
        db.url_params = frozenset(params)   # set in the URL: not to be overridden
        return db
    raise DatabaseURLError(f"database url {describe_url(url)!r}: unsupported scheme (use sqlite:// or postgresql://)")


def connect(url: str, create: bool = True, identity: tuple[int, int] | None = None) -> Database:
    """Open the database at `url`, bind the model proxy to it and return it."""
    db = open_database(url, create, identity)
    database.initialize(db)
    return db


def is_postgres(db: Database | DatabaseProxy | None = None) -> bool:
    """True when the (bound) database is PostgreSQL."""
    target = db if db is not None else database
    if isinstance(target, DatabaseProxy):
        target = target.obj
    return isinstance(target, PostgresqlDatabase)
