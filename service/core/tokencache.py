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
  logic_token_revoked` in its transaction; each process runs a
  `RevocationListener` thread with its own connection that `LISTEN`s and
  empties the cache on every notification.  While that connection is down
  (or not yet up) the cache is bypassed: every call runs the query, so a
  missed notification can never keep a revoked token alive.
- The node that revokes also calls `clear()` itself before answering.

Negative answers are never cached (failed authentications are throttled per
IP by the caller instead).
"""
from __future__ import annotations

import logging
import select
import threading
from datetime import datetime
from typing import Any, Callable

from peewee import Database, SqliteDatabase

from models.clock import utcnow
from models.db import database
from service.core.tokens import REVOKED_CHANNEL, TOUCH_EVERY, TokenIdentity, lookup_api_token

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
        self.listener: RevocationListener | None = None

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
        elif self.listener is not None and self.listener.listening:
            mark = ("pg", self.listener.generation)
        else:
            mark = None     # no way to hear revocations: never trust the cache
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


class RevocationListener:
    """`LISTEN logic_token_revoked` on its own PostgreSQL connection, in a thread.

    `generation` grows on every notification and on every (re)connection (a
    notification may have been missed while down); `listening` is False
    while the connection is down.
    """

    def __init__(self, db: Database, on_change: Callable[[], Any] | None = None,
                 retry_s: float = 1.0) -> None:
        self._db = db
        self._on_change = on_change
        self._retry = retry_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.listening = False
        self.generation = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="logic-token-listener",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _changed(self) -> None:
        self.generation += 1
        if self._on_change is not None:
            self._on_change()

    def _run(self) -> None:
        import psycopg2  # type: ignore[import-untyped]
        import psycopg2.extensions  # type: ignore[import-untyped]
        while not self._stop.is_set():
            conn = None
            try:
                params = {**self._db.connect_params}
                conn = psycopg2.connect(dbname=self._db.database, **params)
                conn.set_isolation_level(psycopg2.extensions.ISOLATION_LEVEL_AUTOCOMMIT)
                conn.cursor().execute(f"LISTEN {REVOKED_CHANNEL}")
                self._changed()
                self.listening = True
                while not self._stop.is_set():
                    if select.select([conn], [], [], 1.0)[0]:
                        conn.poll()
                        if conn.notifies:
                            conn.notifies.clear()
                            self._changed()
                    else:
                        conn.poll()     # notices a dropped connection
            except Exception:  # noqa: BLE001 - any failure: bypass the cache, retry
                if self.listening:
                    log.warning("token revocation listener lost its connection; retrying",
                                exc_info=True)
            finally:
                self.listening = False
                self._changed()
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:  # noqa: BLE001
                        pass
            self._stop.wait(self._retry)


__all__ = ["TokenCache", "RevocationListener"]
