"""Which database errors mean "the connection is lost", as opposed to an error the server reported.

The endpoint lookup (`service.core.invoke_target.TargetCache`) serves
remembered answers only while PostgreSQL is unreachable: a server that is up
may be committing changes from other nodes meanwhile, so an error it reports
itself (too many clients, a cancelled query, authentication) must never count
as an outage. psycopg2 gives a SQLSTATE for an error on an open connection,
but none for a connection that could not be opened (its text only), hence
both checks below.
"""
from __future__ import annotations

#: SQLSTATEs of a connection the server ended or does not accept yet: class 08
#: (connection exception), 57P01-57P03 (shut down, crashed, starting up).
_LOST_STATES = ("57P01", "57P02", "57P03")
#: libpq's words when a connection failed with no SQLSTATE (refused, timed out,
#: reset, closed: the server said nothing, or that it is going away / not up).
_LOST_TEXTS = (
    "connection refused", "timeout expired", "timed out", "no route to host",
    "network is unreachable", "could not translate host name", "no such file or directory",
    "server closed the connection", "connection already closed", "no connection to the server",
    "could not receive data from server", "could not send data to server",
    "ssl syscall error", "ssl connection has been closed", "connection reset",
    "terminating connection due to administrator command",
    "the database system is starting up", "the database system is shutting down",
    "the database system is in recovery mode", "the database system is not",
    # models.db.MissingDatabaseFile (peewee may re-raise it as OperationalError):
    # a SQLite file removed or replaced while the service ran.
    "no such database file", "database file was removed", "put in place of the database",
)


def connection_lost(err: BaseException) -> bool:
    """True when `err` (peewee's wrapper or psycopg2's own) says the connection
    to the database failed or ended: refused, timed out, reset, closed by a
    server that stops, crashed or is still starting.

    False for what a server that is up reports: too many clients, a cancelled
    query (statement timeout), authentication, a serialization failure... A
    server refusing a connection says so with `FATAL:` and its reason; libpq
    may join that to another address's failure (`localhost` tried as ::1, then
    127.0.0.1), so a server's FATAL other than the going-away ones wins.
    """
    orig = err.args[0] if err.args and isinstance(err.args[0], BaseException) else err
    state = getattr(orig, "pgcode", None)
    if state:
        return str(state).startswith("08") or state in _LOST_STATES
    text = str(orig).lower()
    if not any(words in text for words in _LOST_TEXTS):
        return False
    for said in text.split("fatal:")[1:]:
        said = said.split("\n", 1)[0]   # the server's line, not another address's
        if not any(words in said for words in _LOST_TEXTS):
            return False   # the server itself refused (e.g. "too many clients already")
    return True


def server_answered(err: BaseException) -> bool:
    """True when `err` is the server's own answer (a SQLSTATE, or a `FATAL:`
    line that is not one of a server going away): it is up, and may be
    committing changes. False for anything else, a lost connection included."""
    orig = err.args[0] if err.args and isinstance(err.args[0], BaseException) else err
    if getattr(orig, "pgcode", None):
        return not connection_lost(err)
    return "fatal:" in str(orig).lower() and not connection_lost(err)
