"""`ChangeFeed`: a PostgreSQL `LISTEN` connection that tells a process's caches when their data changed.

Every commit that touches a guild, script or endpoint sends a notification
on `logic_targets` (the invoke path's endpoint lookups; migrations 0004 and
0009); revoking an API token sends one on `logic_token_revoked` (the admin
API's token cache). One feed per process listens on both.  A feed owns one
dedicated connection (autocommit, `LISTEN`) and one daemon thread that waits
on it; each notification batch bumps `generation`.  A cache that remembered
answers under generation G drops them as soon as it sees G+1.

Channels are per schema (`scoped`): the name carries a digest of the schema
that holds the tables, so installations that share one database in different
schemas (`search_path`) never empty each other's endpoint caches.  The feed
learns its channels on every connect from where `endpoint` resolves on that
connection, as the service's own queries resolve it (`SUFFIX_SQL`).  (The
unscoped channels are still sent, for nodes of the release before during a
rolling upgrade; this release listens to the unscoped `logic_token_revoked`
too, which such a node sends when it revokes a token, so another
installation's revocation still empties this one's token cache: rare, and
too many flushes, never too few.)

Never staler than the notification's delivery:
- `generation` is None whenever the feed cannot vouch for the data: before
  the first `LISTEN` is in place, after the connection is lost (the server
  closed it, a backend was terminated, a heartbeat query failed or has
  waited longer than `heartbeat_timeout_s`), and until a new connection
  listens again.
  Callers then query the database for every lookup.
- a reconnect bumps the generation, so nothing remembered across a gap in
  the feed survives it;
- a notification that has reached this process's socket but not yet been
  read by the thread also makes `generation` None (a zero-timeout poll of the
  socket, ~1 µs), and so does one the thread has read but not yet counted
  (from each read of the socket until what it brought is counted, a
  heartbeat's round trip included: outside review, session 21, where a
  notification read just before a slow heartbeat went uncounted for the
  heartbeat's whole round trip), so a request never wins a race against the
  feed's thread.

What remains is delivery: a commit is in force on a node once its
notification reached that node (sub-millisecond on one host or LAN).  If the
listening backend dies after a commit queued a notification for it and
before delivering it, the change is in force once the connection's loss
reaches the node (the server's goodbye or a TCP reset: milliseconds), and a
silently dead network is noticed within the TCP keepalive bound (about 4 s:
`keepalives_idle` 2 s + 2 probes of 1 s, `tcp_user_timeout` 3 s).  A
connection that stays up while the backend behind it stops (a stuck
backend, or a proxy or pooler that keeps the client side open) is what
keepalives cannot see: every `heartbeat_s` the thread runs `SELECT 1` on
the connection, and from `heartbeat_timeout_s` after it was sent without an
answer the feed vouches for nothing (the hot path reads the time the query
went out); then the socket is shut down, the query fails, the loss is
counted as any other (`_lost`: notifications read with the heartbeat still
count) and the feed reconnects. (The shutdown came at twice the timeout
before, and remembered endpoints got 503 in between: outside attack pass,
session 34.)  Lookups during a heartbeat's round trip go to the
database (a fraction of a millisecond every `heartbeat_s` on a healthy
server): the price of the bound.
"""
from __future__ import annotations

import hashlib
import logging
import os
import select
import socket
import threading
import time
from typing import Any

from models.db_errors import server_answered

log = logging.getLogger("logic.change_feed")

CHANNEL = "logic_targets"
#: Revoked API tokens (sent by `service.core.tokens.revoke_api_token`).
TOKENS_CHANNEL = "logic_token_revoked"
#: The suffix of this installation's channels: the first 16 hex digits of the
#: SHA-256 of the name of the schema that a connection's unqualified names
#: resolve to (`endpoint` is in every schema this service migrated), computed
#: by the server with the very expression of migration 0009's trigger and of
#: `service.core.tokens.REVOKED_NOTIFY_SQL` (the name itself never travels, so
#: no client encoding can fail on it).
def suffix_of(table: str) -> str:
    """SQL for the channel suffix of the schema that `table` resolves to here."""
    return ("left(encode(sha256(convert_to(COALESCE((SELECT n.nspname FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            f"WHERE c.oid = to_regclass('{table}')), current_schema(), 'public')::text, "
            "'UTF8')), 'hex'), 16)")


SUFFIX_SQL = "SELECT " + suffix_of("endpoint")


def scoped(channel: str, suffix: str) -> str:
    """`channel` for the installation whose `SUFFIX_SQL` is `suffix`:
    ``<channel>_<16 hex digits>`` (a valid channel name of at most 36 characters)."""
    return f"{channel}_{suffix}"


def schema_suffix(schema: str) -> str:
    """What `SUFFIX_SQL` gives for `schema` (for tests and operators)."""
    return hashlib.sha256(schema.encode("utf-8")).hexdigest()[:16]


#: `application_name` of the feed's connection (plus "/<pid>"), to find it in pg_stat_activity.
APPLICATION_NAME = "logic-change-feed"
#: Seconds between heartbeat queries on the feed's connection.
HEARTBEAT_S = 2.0
#: Seconds a heartbeat may wait for its answer before the feed stops vouching
#: and its connection is shut down and made again.
HEARTBEAT_TIMEOUT_S = 2.0


class ChangeFeed:
    """Listens for endpoint-data changes on PostgreSQL; see the module docstring."""

    def __init__(self, connect_kwargs: dict[str, Any], *, channels: tuple[str, ...] = (CHANNEL,),
                 retry_s: float = 0.5, heartbeat_s: float = HEARTBEAT_S,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        self._channels = channels
        self._heartbeat_s, self._heartbeat_timeout_s = heartbeat_s, heartbeat_timeout_s
        #: `time.monotonic()` when the heartbeat query now waiting for its answer was sent.
        self._beat_sent: float | None = None
        #: True while the thread reads the socket, until what it read is counted:
        #: a notification read off the socket (so no longer "readable") but not
        #: yet counted must not let the old generation pass for current.
        self._reading = False
        # Always its own name, even when the URL names the service's connections.
        self._connect_kwargs = {**connect_kwargs,
                                "application_name": f"{APPLICATION_NAME}/{os.getpid()}"}
        self._retry_s = retry_s
        self._generation = 0
        self._healthy = False
        # (generation, time.monotonic()) when the connection broke; one tuple,
        # so a reader never sees one outage's generation with another's time.
        self._vouched: tuple[int, float] | None = None
        self._conn: Any = None
        self._poller: select.poll | None = None
        self._watched = -1   # the duplicate of the connection's socket that `_poller` polls
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reconnects = 0
        #: The suffix of the channels the feed listens to (`SUFFIX_SQL`, set on every connect).
        self.suffix: str | None = None

    @classmethod
    def for_database(cls, db: Any, **kwargs: Any) -> ChangeFeed:
        """A feed on the same server and database as the peewee `db`."""
        params = dict(db.connect_params)
        params.setdefault("connect_timeout", 5)
        # A silently dead network must surface as an error, not a blocked read:
        # sooner here than on the other connections, unless the URL says.
        given: frozenset[str] = getattr(db, "url_params", frozenset())
        for name, value in (("keepalives", 1), ("keepalives_idle", 2), ("keepalives_interval", 1),
                            ("keepalives_count", 2), ("tcp_user_timeout", 3000)):
            if name not in given:
                params[name] = value
        return cls({"dbname": db.database, **params}, **kwargs)

    # ------------------------------------------------------------ hot path
    @property
    def generation(self) -> int | None:
        """The current generation, or None when cached answers must not be trusted."""
        if not self._healthy or self._reading:
            return None
        sent = self._beat_sent
        if sent is not None and time.monotonic() - sent > self._heartbeat_timeout_s:
            return None          # the backend has not answered the heartbeat: stalled
        poller = self._poller
        if poller is not None and poller.poll(0):
            return None          # a notification is waiting for the thread: do not guess
        return self._generation

    # ------------------------------------------------------------ lifecycle
    def start(self, wait_s: float = 5.0) -> ChangeFeed:
        """Start the thread; wait up to `wait_s` for the first LISTEN (not an error if it is late)."""
        self._thread = threading.Thread(target=self._run, name="change-feed", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + wait_s
        while not self._healthy and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._healthy = False
        self._drop()
        self._close_watched()

    def _close_watched(self) -> None:
        watched, self._watched = self._watched, -1
        if watched >= 0:
            os.close(watched)

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def vouched_until(self) -> int | None:
        """While the feed cannot vouch: the generation that was current when its
        connection broke (its heartbeat unanswered for `heartbeat_timeout_s`
        breaks it too; None before it ever listened, while listening, and once
        the server itself refused a reconnect: it is up and may commit).
        Answers read under it reflect every change whose notification reached
        this process before the break (see `TargetCache`'s outage rule)."""
        vouched = self.vouch
        return None if vouched is None else vouched[0]

    @property
    def lost_at(self) -> float | None:
        """While the feed cannot vouch: when (`time.monotonic()`) this process
        noticed its connection broke, the moment its `vouched_until` answers
        stopped being vouched for (None before it ever listened, and while
        listening). `TargetCache` serves them for `outage_serve_s` after it."""
        vouched = self.vouch
        return None if vouched is None else vouched[1]

    @property
    def vouch(self) -> tuple[int, float] | None:
        """(`vouched_until`, `lost_at`) read at once: one outage's generation
        never with another's time (two reads could straddle a reconnect and
        a new loss)."""
        vouched = self._vouched
        return None if self._healthy else vouched

    # ------------------------------------------------------------ thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._connect()
                self._listen_loop()
            except Exception as err:  # noqa: BLE001 - any failure means: cannot vouch
                was_healthy = self._healthy
                self._lost()   # first: a lookup meanwhile must see the loss at once
                if server_answered(err):
                    # The server itself said no (a reconnect refused: too many
                    # clients, a database not accepting connections): it is up,
                    # so changes may commit that no notification announces to
                    # this feed. What was read before is vouched for no more
                    # (review, session 33: served again in a later outage).
                    self._vouched = None
                if was_healthy or self.reconnects == 0:
                    log.warning("change feed lost (%s): endpoint lookups query the database "
                                "until it is back", type(err).__name__)
            self._lost()   # also when the loop ended on stop (no exception); idempotent
            self._drop()
            self._stop.wait(self._retry_s)

    def _connect(self) -> None:
        import psycopg2  # type: ignore[import-untyped,unused-ignore]
        conn = psycopg2.connect(**self._connect_kwargs)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(SUFFIX_SQL)
            self.suffix = str(cur.fetchone()[0])
            for channel in self._channels:
                cur.execute(f'LISTEN "{scoped(channel, self.suffix)}"')
                if channel == TOKENS_CHANNEL:
                    # A node of the release before revokes on the unscoped channel
                    # only (no trigger sends it for that node): heard, so a
                    # revocation during a rolling upgrade is never missed.
                    cur.execute(f'LISTEN "{channel}"')
        # The hot path polls its own duplicate of the socket: libpq closes the
        # connection's descriptor when it reads the server's goodbye, and that
        # number, reused by any new descriptor, must never pass for the feed's.
        # The duplicate stays open (end of file: "do not trust") until the next
        # connection's replaces it or the feed stops.
        watched = os.dup(conn.fileno())
        poller = select.poll()
        poller.register(watched, select.POLLIN | select.POLLERR | select.POLLHUP)
        self._close_watched()
        self._conn, self._poller, self._watched = conn, poller, watched
        # Anything remembered before this LISTEN may have missed a change.
        self._generation += 1
        self._healthy = True
        self.reconnects += 1
        if self.reconnects > 1:
            log.info("change feed listening again; endpoint lookups cached again")

    def _listen_loop(self) -> None:
        # Nothing but notifications, heartbeat answers and the server's goodbye
        # arrives on this socket, so "readable" on the hot path means
        # "something may have changed or the feed is gone" (or, for a moment,
        # a heartbeat's answer).
        conn = self._conn
        beat_at = time.monotonic() + self._heartbeat_s
        while not self._stop.is_set():
            ready, _, _ = select.select([conn], [], [], min(0.25, self._heartbeat_s))
            beat = time.monotonic() >= beat_at
            if not (ready or beat):
                continue
            # From the first read until what it brought is counted (a heartbeat
            # in between can take up to its timeout), nothing is vouched for.
            self._reading = True
            try:
                if ready:
                    conn.poll()                  # raises when the server closed the connection
                if beat:
                    self._heartbeat(conn)        # raises when the backend did not answer
                    beat_at = time.monotonic() + self._heartbeat_s
                if conn.notifies:
                    conn.notifies.clear()
                    self._generation += 1
            finally:
                self._reading = False

    def _heartbeat(self, conn: Any) -> None:
        """`SELECT 1` on the feed's own connection; shut down if unanswered for
        `heartbeat_timeout_s` (the query then fails and the feed reconnects)."""
        cut = threading.Timer(self._heartbeat_timeout_s, self._cut, args=(self._watched,))
        cut.daemon = True
        self._beat_sent = time.monotonic()
        cut.start()
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT 1")
        finally:
            cut.cancel()
            self._beat_sent = None

    @staticmethod
    def _cut(watched: int) -> None:
        """Shut the connection's socket down (through the feed's duplicate of it)."""
        try:
            sock = socket.socket(fileno=os.dup(watched))
        except OSError:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.close()

    def _set_unhealthy(self) -> None:
        self._healthy = False

    def _lost(self) -> None:
        """The connection broke: remember up to which generation the feed vouched."""
        if self._healthy:
            conn = self._conn
            # Notifications that arrived together with the goodbye still count.
            if conn is not None and getattr(conn, "notifies", None):
                conn.notifies.clear()
                self._generation += 1
            self._vouched = (self._generation, time.monotonic())
        self._healthy = False

    def _drop(self) -> None:
        conn, self._conn, self._poller = self._conn, None, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass
