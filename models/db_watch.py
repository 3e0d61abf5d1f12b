"""Giving up on a thread's PostgreSQL statement: cancel it on the server, free the thread.

A `StatementWatch` is installed on the thread that runs the statements
(`ReconnectingPostgresqlDatabase.watching`). While it is, the database tells
it the connection each statement runs on (`attach`, on that thread, before
the statement) and when a statement runs (`running`). Another thread that
decides the statement has waited too long gives up on it:

1. `abandon()`: from now on the database's automatic reconnect never runs
   the statement again. (It would: once the socket is shut, libpq reports
   "server closed the connection", one of the reconnect errors, and peewee's
   `ReconnectMixin` ran the query again on a new socket nobody watched; a
   statement blocked by a lock kept its thread for as long as the lock
   lasted. Outside attack pass, session 34.)
2. `cancel(grace)`: asks the server to cancel it, `pg_cancel_backend` over a
   new connection, made without blocking and given up after `grace` seconds.
   psycopg2's `connection.cancel()` is not used: it holds the GIL while it
   waits for the server's answer, so a stalled server or proxy would freeze
   the whole process (every thread, the event loop included), for ever.
3. `shut()`: shuts the connection's socket (through a duplicate taken in
   `attach`), so a statement still waiting fails now. A statement given up
   on ends its connection either way: the database closes it (or, inside a
   transaction, shuts it) once the statement returns, so a cancel that lands
   late can never hit another statement.

Each connection attached also gets a server-side `statement_timeout` of
`server_timeout_s` (lowered to it, never raised: an operator's lower one
stands), should the cancel not reach the server.
"""
from __future__ import annotations

import os
import select
import socket
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import peewee
from peewee import OperationalError

#: A cancel's connection and query, at most (`StatementWatch.cancel`'s default grace).
CANCEL_GRACE_S = 0.5

_BELT_SQL = ("SELECT set_config('statement_timeout', %s, false) "
             "WHERE current_setting('statement_timeout')::interval "
             "NOT BETWEEN interval '1 ms' AND %s::interval")

#: The connections that got their server-side bound (ms), so that each gets it once.
_belted: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_belted_lock = threading.Lock()


class StatementWatch:
    """What a thread's running statement needs to be given up on from another thread."""

    def __init__(self, server_timeout_s: float | None = None) -> None:
        #: Given up on: never retried, and nothing more runs on its connection.
        self.abandoned = False
        self._server_timeout_ms = (None if server_timeout_s is None
                                   else max(1, int(server_timeout_s * 1000)))
        self._lock = threading.Lock()
        self._conn: Any = None          # the psycopg2 connection last attached
        self._fd: int | None = None     # a duplicate of its socket
        self._pid: int | None = None    # its backend
        self._target: tuple[str, dict[str, Any]] | None = None   # (dbname, connect params)
        self._running = False           # a statement runs (`running`)
        self._final = False             # ... and it is a COMMIT: never given up on
        #: What the statement given up on ran on, taken when it was given up on
        #: (`_take_aim`): (backend pid, target, a duplicate of its socket). The
        #: cancel and the shutdown go there, never to a later statement's.
        self._aim: tuple[int | None, tuple[str, dict[str, Any]] | None, int | None] | None = None

    # On the watched thread -------------------------------------------------

    def attach(self, db: Any) -> None:
        """Before a statement: note the connection it runs on (opening it if
        needed), and give a new one its server-side bound."""
        if self.abandoned:
            raise OperationalError("the database connection timed out: the statement "
                                   "was given up on")
        if db.is_closed():
            with self._lock:   # a reconnect: the last backend is no target any more
                self._close_fd()
                self._conn = self._pid = None
        conn = db.connection()
        if conn is self._conn:
            return
        try:
            fd: int | None = os.dup(conn.fileno())
        except Exception:  # noqa: BLE001 - closed (the statement says so), or no socket
            fd = None
        try:
            pid: int | None = int(conn.info.backend_pid)
        except Exception:  # noqa: BLE001 - as above
            pid = None
        with self._lock:
            self._close_fd()
            self._conn, self._fd, self._pid = conn, fd, pid
            self._target = (db.database, dict(db.connect_params))
        bound = self._server_timeout_ms
        if bound is not None:
            with _belted_lock:
                done = _belted.get(conn) == bound
            if not done:
                with peewee.__exception_wrapper__:   # type: ignore[attr-defined]
                    with conn.cursor() as cur:
                        cur.execute(_BELT_SQL, (f"{bound}ms", f"{bound} ms"))
                with _belted_lock:
                    _belted[conn] = bound

    @contextmanager
    def running(self, final: bool = False) -> Iterator[None]:
        """Around one statement: from its start to its end (with its retry).
        `final`: a COMMIT, which a `DeadlineWatch` never gives up on."""
        with self._lock:
            self._running, self._final = True, final
        try:
            yield
        finally:
            with self._lock:
                self._running = self._final = False

    def timed_out(self, err: BaseException) -> Exception | None:
        """What a statement given up on raises instead of `err` (None: `err`)."""
        return None

    def detach(self) -> None:
        """The watched thread is done with the watch: its duplicates are closed."""
        with self._lock:
            self._close_fd()
            self._drop_aim()
            self._conn = None

    # From another thread ---------------------------------------------------

    def abandon(self) -> bool:
        """Give up on the statement running now, or any the thread would begin;
        True when one was running (then `cancel` and `shut` are for it)."""
        with self._lock:
            self.abandoned = True
            if self._running:
                self._take_aim()
            return self._running

    def _take_aim(self) -> None:
        """(Lock held.) Note what the statement given up on runs on."""
        fd = None
        if self._fd is not None:
            try:
                fd = os.dup(self._fd)
            except OSError:
                fd = None
        self._drop_aim()
        self._aim = (self._pid, self._target, fd)

    def _drop_aim(self) -> None:
        aim, self._aim = self._aim, None
        if aim is not None and aim[2] is not None:
            try:
                os.close(aim[2])
            except OSError:
                pass

    def cancel(self, grace: float = CANCEL_GRACE_S) -> bool:
        """Ask the server to cancel the statement given up on (see the module
        docstring); True when it signalled the backend. Blocks `grace` seconds
        at most, without holding the GIL."""
        with self._lock:
            pid, target = self._aim[:2] if self._aim is not None else (None, None)
        if pid is None or target is None:
            return False
        return cancel_backend(target[0], target[1], pid, grace)

    def shut(self) -> None:
        """Shut the socket of the statement given up on: waiting, it fails now."""
        with self._lock:
            aim = self._aim
            fd = aim[2] if aim is not None else None
            if aim is not None:
                self._aim = (aim[0], aim[1], None)
        if fd is None:
            return
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            return
        with sock:   # closes the duplicate
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _close_fd(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


class StatementTimedOut(OperationalError):
    """A statement a `DeadlineWatch` gave up on: no answer within its limit."""


class DeadlineWatch(StatementWatch):
    """Gives up on any statement of its thread still running `limit` seconds
    after it began (its connection included): a thread of its own watches
    the clock. The statement then fails with `StatementTimedOut` (the
    database raises it in place of the error the give-up caused), and the
    next one starts afresh (on a new connection: the database reconnects)."""

    def __init__(self, limit: float, server_timeout_s: float | None = None,
                 name: str = "logic-db-watch", grace: float = CANCEL_GRACE_S) -> None:
        super().__init__(server_timeout_s)
        self.limit = limit
        self.grace = grace
        #: Statements given up on so far.
        self.gave_up = 0
        self._cond = threading.Condition(self._lock)
        self._serial = 0
        self._started_at = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)
        self._thread.start()

    @contextmanager
    def running(self, final: bool = False) -> Iterator[None]:
        with self._cond:
            self.abandoned = False
            self._drop_aim()
            self._serial += 1
            self._started_at = time.monotonic()
            self._running, self._final = True, final
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._running = self._final = False
                self._cond.notify_all()

    def timed_out(self, err: BaseException) -> Exception | None:
        return StatementTimedOut(f"timed out: no answer within {self.limit:g} s")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _watch(self) -> None:
        seen = 0   # the last statement looked at
        while True:
            with self._cond:
                while not self._closed and not (self._running and self._serial != seen):
                    self._cond.wait()
                if self._closed:
                    return
                seen = self._serial
                deadline = self._started_at + self.limit
                while self._running and self._serial == seen and not self._closed:
                    left = deadline - time.monotonic()
                    if left > 0:
                        self._cond.wait(left)
                    elif self._final:
                        # A COMMIT is never given up on: it may be applied
                        # already, and the batch, retried, would count twice
                        # (review, session 34). It ends when its connection does.
                        self._cond.wait()
                    else:
                        break
                if self._closed or not (self._running and self._serial == seen):
                    continue
                self.abandoned = True
                self.gave_up += 1
                self._take_aim()
            self.cancel(self.grace)
            with self._cond:
                settle = time.monotonic() + self.grace / 2
                while self._running and self._serial == seen and time.monotonic() < settle:
                    self._cond.wait(settle - time.monotonic())
                stuck = self._running and self._serial == seen
            if stuck:
                self.shut()


def cancel_backend(dbname: str, params: dict[str, Any], pid: int, timeout: float) -> bool:
    """`pg_cancel_backend(pid)` over a new, asynchronous connection; True when
    the server signalled the backend. Gives up after `timeout` seconds (a
    stalled or unreachable server): never blocks longer, never holds the GIL
    while it waits."""
    import psycopg2  # type: ignore[import-untyped,unused-ignore]

    deadline = time.monotonic() + timeout
    try:
        conn = psycopg2.connect(dbname=dbname, async_=True, **params)
    except psycopg2.Error:
        return False
    try:
        _wait(conn, deadline)
        cur = conn.cursor()
        cur.execute("SELECT pg_cancel_backend(%s)", (pid,))
        _wait(conn, deadline)
        row = cur.fetchone()
        return bool(row and row[0])
    except (psycopg2.Error, OSError, TimeoutError):
        return False
    finally:
        try:
            conn.close()
        except psycopg2.Error:
            pass


def _wait(conn: Any, deadline: float) -> None:
    """Drive an asynchronous psycopg2 connection until its operation is done."""
    import psycopg2.extensions as ext  # type: ignore[import-untyped,unused-ignore]

    while True:
        state = conn.poll()
        if state == ext.POLL_OK:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError()
        if state == ext.POLL_READ:
            select.select([conn.fileno()], [], [], left)
        elif state == ext.POLL_WRITE:
            select.select([], [conn.fileno()], [], left)
        else:
            raise OSError(f"unexpected poll state {state}")
