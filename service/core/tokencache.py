"""`TokenCache`: API token lookups from memory, never honouring a revoked token.

A hit costs no hash and no query: entries are keyed by the presented token
itself (a dict lookup), and hold the token's id, actor and expiry.  Expiry is
checked on every hit from the cached `expiresAt`.  `lastUsedAt` is written at
most once a minute per token (`due_touch`, done by the caller off the loop).

Revocation takes effect at once, on every node:
- **SQLite** (one node, possibly several processes such as the `logic` CLI):
  `PRAGMA data_version` of the checking thread's connection changes whenever
  any other connection commits; then every entry is dropped.  A revocation
  commits, so the next check misses.  (Other commits, e.g. the records
  writer's, also empty the cache: a miss costs one indexed query.)
- **PostgreSQL** (several nodes): `revoke_api_token` sends `NOTIFY
  logic_token_revoked` in its transaction; each process's change feed
  (`models.change_feed.ChangeFeed`, one `LISTEN` connection on a thread)
  bumps its generation on every notification, which empties the cache.  While that connection is down
  (or not yet up) the cache is bypassed: every call runs the query, so a
  missed notification can never keep a revoked token alive.
- The node that revokes also calls `clear()` itself before answering.

Negative answers are never cached (failed authentications are throttled per
IP by the caller instead).
"""
from __future__ import annotations

import logging
from datetime import datetime

from peewee import SqliteDatabase

from models.change_feed import ChangeFeed
from models.clock import utcnow
from models.db import database
from service.core.tokens import TOUCH_EVERY, TokenIdentity, lookup_api_token

log = logging.getLogger("logic.core")


class _Entry:
    __slots__ = ("identity", "touched")

    def __init__(self, identity: TokenIdentity, touched: datetime) -> None:
        self.identity = identity
        self.touched = touched


class TokenCache:
    """Remembers valid tokens until a revocation could have happened (module docstring)."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self._max = max_entries
        self._entries: dict[str, _Entry] = {}
        self._stamp: object = None
        self._conn: object = None
        #: On PostgreSQL: the process's `models.change_feed.ChangeFeed`, listening
        #: on `logic_token_revoked`; without one the cache is never trusted.
        self.feed: ChangeFeed | None = None

    def clear(self) -> None:
        self._entries.clear()
        self._stamp = None

    def stamp(self) -> object:
        """The current freshness mark; entries made under another mark are gone.

        Call on the thread that calls `get` (the event loop's)."""
        db = database.obj
        if isinstance(db, SqliteDatabase):
            conn = db.connection()  # type: ignore[no-untyped-call]
            version = conn.execute("PRAGMA data_version").fetchone()[0]
            mark: object = (id(conn), version)
        else:
            generation = self.feed.generation if self.feed is not None else None
            # None: no way to hear revocations right now: never trust the cache.
            mark = None if generation is None else ("pg", generation)
        if mark != self._stamp or mark is None:
            self._entries.clear()
            self._stamp = mark
        return mark

    def get(self, token: str) -> TokenIdentity | None:
        """The cached identity of a valid token, or None (a miss: look it up)."""
        if self.stamp() is None:
            return None
        entry = self._entries.get(token)
        if entry is None:
            return None
        if entry.identity.expired(utcnow()):
            del self._entries[token]
            return None
        return entry.identity

    def due_touch(self, token: str) -> int | None:
        """The token id when its `lastUsedAt` is a minute old (then marked done)."""
        entry = self._entries.get(token)
        if entry is None:
            return None
        now = utcnow()
        if entry.touched > now - TOUCH_EVERY:
            return None
        entry.touched = now
        return entry.identity.token_id

    def put(self, token: str, identity: TokenIdentity, stamp: object) -> None:
        """Remember a looked-up identity, if nothing changed since `stamp` was taken."""
        if stamp is None or stamp != self._stamp:
            return
        if len(self._entries) >= self._max:
            self._entries.clear()
        self._entries[token] = _Entry(identity, utcnow())

    @staticmethod
    def lookup(token: str) -> TokenIdentity | None:
        """The database lookup of a miss (run it off the event loop)."""
        return lookup_api_token(token)


__all__ = ["TokenCache"]
