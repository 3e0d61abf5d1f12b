"""The invoke path's one read: everything a request needs, in one indexed query.

`TargetCache` serves repeated lookups from memory (SQLite: its WAL index
header, `service.core.wal_index`; PostgreSQL: the change feed) without ever
serving a stale one, runs PostgreSQL's queries off the event loop, and answers
from memory what it can, for at most `outage_serve_s`, while PostgreSQL is
unreachable (see its docstring and `service.core.target_outage`;
`connection_lost` tells "unreachable" from an error the server reported).

What it remembers is `load_target`'s answer (`service.core.target_read`, the
one indexed query; re-exported here with `InvokeTarget`).
"""
from __future__ import annotations

import asyncio
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

from peewee import InterfaceError, OperationalError, SqliteDatabase

from models.change_feed import ChangeFeed
from models.db import database
from models.db_errors import connection_lost
from service.core.lookup_query import (SKIPPED, Backlogged, LookupStalled, Query, answer_of,
                                       feed_noticed, retrieve)
from service.core.target_outage import PROBE_GAP_S, OutageRule, TargetsUnavailable
from service.core.target_read import InvokeTarget, load_target
from service.core.target_generation import generation
from service.core.wal_index import WalIndex
from service.plans import DEFAULT_PLANS, Plan

__all__ = ["InvokeTarget", "load_target", "TargetCache", "TargetsUnavailable", "NeedsQuery",
           "NEEDS_QUERY"]

#: Lookups waiting for a query thread; past it a lookup is refused (TargetsUnavailable).
MAX_PENDING = 256
#: A lookup that found the connection lost while the change feed still listens
#: waits this long at most for the feed's thread to notice the same loss (it
#: does within milliseconds when the server went away: see `TargetCache.fetch`).
FEED_NOTICE_S = 1.0
#: How long remembered answers are served once the change feed's connection
#: broke (`database.outage_serve_s`); 0: never (fail closed).
OUTAGE_SERVE_S = 30.0
#: A lookup's query unanswered after this long is cancelled; with no answer to
#: the cancel either it counts as a lost connection: a server, proxy or network
#: that keeps the connection open but answers nothing (the lookup thread's
#: socket is then shut, which frees the thread; `service.core.lookup_query`).
LOOKUP_TIMEOUT_S = 2.0
#: The lookup threads' sessions cancel a statement themselves after this long
#: past `lookup_timeout_s` (`statement_timeout`), should the cancel not reach them.
SERVER_MARGIN_S = 3.0


class NeedsQuery:
    """`TargetCache.lookup`'s answer when only a query can decide: await `fetch`."""


NEEDS_QUERY = NeedsQuery()


_MISSING = object()


class TargetCache(OutageRule):
    """`load_target` that remembers answers until the database changes.

    Exact, never stale: on SQLite, the WAL index header (`WalIndex`; `PRAGMA
    data_version` outside WAL mode) changes whenever a connection — another
    thread's, or another process's such as the `logic` CLI — commits; then
    the generation that triggers keep (`target_generation`: every change of a
    guild, script or endpoint row counts) is read, and if it moved, or cannot
    vouch, every remembered answer is dropped (a commit of the records writer
    keeps them). So a regenerated secret, a disabled
    endpoint or a new whitelist take effect on the very next request, as
    without the cache. Reading the header costs a memory read against ~15 µs
    for the join. Where the pragma answers, writes through this thread's own
    connection do not change its data_version: whoever writes through it must
    call `invalidate()` (the service's loop thread only reads).

    On PostgreSQL the same role is played by a `models.change_feed.ChangeFeed`
    (a LISTEN connection that every commit touching a guild, script or
    endpoint notifies): answers are kept while its generation stays the same,
    and every lookup queries the database while the feed cannot vouch (not
    yet listening, connection lost, a notification not yet read). Without a
    feed, other databases run the query on every lookup. The event loop uses
    `lookup()` then, when it says `NEEDS_QUERY`, awaits `fetch()`, which runs
    the query on one of two threads (at most `MAX_PENDING` waiting).

    PostgreSQL unreachable (a query fails with a connection error,
    `connection_lost`, or stalls past `lookup_timeout_s` and its cancel
    brings no answer: a query blocked by a lock is cancelled, no outage):
    the answers read under the generation current when the feed's connection broke
    (`ChangeFeed.vouched_until`) are served as they are, for at most
    `outage_serve_s` after the feed noticed the break (`ChangeFeed.lost_at`;
    0: never), unless the server was seen up since (`_answered_unvouched`).
    Anything else raises `TargetsUnavailable`, as does an error the server
    reports while up. One query at a time probes the server; the first that
    reaches it ends the outage. docs/architecture.md ("PostgreSQL down")
    states the exact guarantee and its limits.

    `clock` is `time.monotonic` (the feed's `lost_at` uses it); tests shift it.
    """

    def __init__(self, plans: Mapping[str, Plan] = DEFAULT_PLANS, max_entries: int = 10_000,
                 feed: ChangeFeed | None = None, *, outage_serve_s: float = OUTAGE_SERVE_S,
                 clock: Callable[[], float] = time.monotonic,
                 lookup_timeout_s: float = LOOKUP_TIMEOUT_S) -> None:
        self._plans = plans
        self._lookup_timeout = lookup_timeout_s
        self._max = max_entries
        self._feed = feed
        self._serve_s = outage_serve_s
        self._clock = clock
        self._refusing = False
        self._expired_logged: float | None = None
        self._entries: dict[tuple[str, str], InvokeTarget | None] = {}
        self._version: object = None
        self._conn: object = None
        self._generation: tuple[int, int] | None = None   # SQLite (`target_generation`)
        self._index: WalIndex | None = None   # SQLite: what committed since the last look
        self._executor: ThreadPoolExecutor | None = None
        self._pending = 0
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._probing = False
        # (loop, task) of the wait for the feed to notice a loss a lookup saw first.
        self._noticing: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None

    @property
    def database_down(self) -> bool:
        """True from a lookup that found PostgreSQL unreachable to the next that reached
        it, or until the change feed listens again (then the server is back)."""
        feed = self._feed
        return self._down_since is not None and (feed is None or not feed.healthy)

    def invalidate(self) -> None:
        self._entries.clear()
        self._version = None
        self._conn = None
        self._generation = None

    def _adopt(self, version: object, conn: object) -> dict[tuple[str, str], InvokeTarget | None]:
        # Versions compare only within one connection: a new connection (a
        # reconnect, another thread) starts a new series.
        if version != self._version or conn is not self._conn:
            self._entries.clear()
            self._version = version
            self._conn = conn
        return self._entries

    def _adopt_sqlite(self, version: object,
                      conn: sqlite3.Connection) -> dict[tuple[str, str], InvokeTarget | None]:
        """`_adopt` for SQLite: a commit that changed no guild, script or endpoint
        (the records writer's) keeps the answers (`target_generation`)."""
        if version != self._version or conn is not self._conn:
            # Read after `version`: a change committed in between moves the
            # header again, so the next lookup looks again.
            now = generation(conn)
            if conn is not self._conn or now is None or now != self._generation:
                self._entries.clear()
            self._version, self._conn, self._generation = version, conn, now
        return self._entries

    def _store(self, key: tuple[str, str], found: InvokeTarget | None) -> None:
        entries = self._entries
        if len(entries) >= self._max:
            entries.clear()  # a flood of unknown IDs must not grow memory
        entries[key] = found

    def __call__(self, guild_id: str, script_id: str) -> InvokeTarget | None:
        """The answer, querying inline when needed (SQLite; PostgreSQL off the hot path).

        Raises `TargetsUnavailable`."""
        found = self.lookup(guild_id, script_id)
        if not isinstance(found, NeedsQuery):
            return found
        feed = self._feed
        version = feed.generation if feed is not None else None
        started = time.monotonic()
        try:
            found = load_target(guild_id, script_id, self._plans)
        except (OperationalError, InterfaceError) as err:
            return self._failed(err, (guild_id, script_id))
        self._reachable()
        if version is not None and version == self._version and self._conn is feed:
            self._store((guild_id, script_id), found)
        elif feed is not None and version is None:
            self._answered_unvouched(feed, started)
        return found

    def lookup(self, guild_id: str, script_id: str) -> InvokeTarget | None | NeedsQuery:
        """The remembered answer, or `NEEDS_QUERY` (PostgreSQL only: await `fetch`).

        Raises `TargetsUnavailable` (PostgreSQL unreachable, nothing vouched for)."""
        db = database.obj
        key = (guild_id, script_id)
        if isinstance(db, SqliteDatabase):
            conn = db.connection()  # type: ignore[no-untyped-call]
            index = self._index
            if index is None or index.conn is not conn:
                index = self._index = WalIndex(conn)
            entries = self._adopt_sqlite(index.changes(), conn)
            found = entries.get(key, _MISSING)
            if found is _MISSING:
                found = load_target(guild_id, script_id, self._plans)
                self._store(key, found)
            return found  # type: ignore[return-value]
        feed = self._feed
        if feed is None:
            return NEEDS_QUERY
        # Read before the query: a change committed meanwhile bumps the
        # generation, and the next lookup drops what this one stores.
        version = feed.generation
        if version is not None:
            found = self._adopt(version, feed).get(key, _MISSING)
            return NEEDS_QUERY if found is _MISSING else found  # type: ignore[return-value]
        if self._down_since is not None and (self._probing or self._clock() < self._retry_at):
            return self._outage_answer(key)
        return NEEDS_QUERY

    async def fetch(self, guild_id: str, script_id: str) -> InvokeTarget | None:
        """The answer after a query on a lookup thread (remembered when the feed vouches).

        Raises `TargetsUnavailable`."""
        noticing = self._noticing
        if noticing is not None and noticing[0] is asyncio.get_running_loop() \
                and not noticing[1].done():
            # Another lookup saw the server go before the feed did: no query
            # until the feed says so (or its bound passed), then as usual.
            await asyncio.shield(noticing[1])
        return await self._fetch(guild_id, script_id, waited=False)

    async def _fetch(self, guild_id: str, script_id: str, waited: bool) -> InvokeTarget | None:
        key = (guild_id, script_id)
        feed = self._feed
        version = feed.generation if feed is not None else None
        if self._pending >= MAX_PENDING:
            raise TargetsUnavailable("too many endpoint lookups are waiting")
        probe = self._down_since is not None and version is None
        if probe:
            # Still no feed: one lookup at a time probes, the others do not wait.
            # (A feed listening again means the server is back: query at once.)
            if self._probing or self._clock() < self._retry_at:
                return self._outage_answer(key)
            self._probing = True
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="logic-lookup")
        self._pending += 1
        query = Query(self._lookup_timeout + SERVER_MARGIN_S)
        future = asyncio.get_running_loop().run_in_executor(
            self._executor, self._query, query, guild_id, script_id, probe)
        future.add_done_callback(retrieve)
        try:
            found = await answer_of(query, future, self._lookup_timeout)
        except (OperationalError, InterfaceError) as err:
            if waited or feed is None or not feed.healthy or not connection_lost(err):
                return self._failed(err, key, cancelled=query.abandoned)
            lost_first = True
        except LookupStalled as err:
            self._unreachable(err, key, answer=False)
            if not waited and feed is not None and feed.healthy:
                await self._feed_notices(feed)   # its heartbeat finds the same stall
            return self._outage_answer(key)
        except Backlogged:
            raise TargetsUnavailable("endpoint lookups are backed up") from None
        else:
            lost_first = False
            if found is SKIPPED:
                return self._outage_answer(key)
        finally:
            self._pending -= 1
            if probe:
                self._probing = False
                self._retry_at = self._clock() + PROBE_GAP_S
        if lost_first:
            # This lookup saw the server go before the feed's thread did: the
            # feed cannot vouch yet, so its answer would be 503 although it was
            # remembered. Wait for the feed (shared by every lookup meanwhile,
            # holding no lookup slot), then start again: an old error must not
            # decide, the server may be back (or have answered) by then.
            assert feed is not None
            await self._feed_notices(feed)
            return await self._fetch(guild_id, script_id, waited=True)
        self._reachable()
        if version is not None and version == self._version and self._conn is feed:
            self._store(key, found)
        elif feed is not None and version is None:
            self._answered_unvouched(feed, query.started)
        return found   # type: ignore[no-any-return]

    def _query(self, query: Query, guild_id: str, script_id: str, probe: bool) -> Any:
        """`load_target` on a lookup thread, under `query` (its connection and
        socket known, for `given_up` should it stall)."""
        # (Plain attributes only: the feed's `generation` polls its socket,
        # which one thread at a time may do, the loop's.)
        feed = self._feed
        if query.abandoned or (not probe and self._down_since is not None
                               and (feed is None or not feed.healthy)):
            return SKIPPED   # given up on, or an outage began while it waited
        query.started = time.monotonic()
        watching = getattr(database.obj, "watching", None)
        if watching is None:
            return load_target(guild_id, script_id, self._plans)
        with watching(query):
            return load_target(guild_id, script_id, self._plans)

    async def _feed_notices(self, feed: ChangeFeed) -> None:
        """The one wait of this loop for the feed to notice the loss (see `fetch`)."""
        loop = asyncio.get_running_loop()
        noticing = self._noticing
        if noticing is None or noticing[0] is not loop or noticing[1].done():
            waiting = asyncio.ensure_future(feed_noticed(feed, FEED_NOTICE_S))
            noticing = self._noticing = (loop, waiting)
        await asyncio.shield(noticing[1])

    def close(self) -> None:
        """Stop the lookup threads."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        self._index = None

