"""Endpoint lookups while the server is up but their query is blocked (a lock).

Runs against a PRIVATE PostgreSQL cluster (`tests/service/http/private_servers.py`),
where another session holds `endpoint` locked (`LOCK TABLE ... ACCESS
EXCLUSIVE`, as a migration does) for longer than `lookup_timeout_s`.

Outside attack pass, session 34: a lookup given up on after 2 s had its
socket shut, which libpq reports as "server closed the connection": peewee's
reconnect mixin then reconnected and ran the query again on a new socket no
one watched, so the lookup thread stayed blocked for the whole lock, later
lookups waited 8 s in the queue, and the first backend's query was never
cancelled (server sessions waiting on the lock long past 2 s).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from service.core.invoke_target import InvokeTarget, TargetCache, TargetsUnavailable
from tests.service.core.test_target_cache_outage import (_answer, _enabled_endpoint,
                                                         _private_db)
from tests.service.http.private_servers import PrivatePostgres, poll

#: A lookup's bound: `lookup_timeout_s` (2 s), the cancel's grace (0.5 s), and
#: some slack for a loaded host.
BOUND_S = 4.0


@pytest.fixture()
def private_db() -> Iterator[tuple[PrivatePostgres, Any]]:
    yield from _private_db("")


def _waiting_on_locks(admin: Any, locker_pid: int, older_than_s: float) -> list[Any]:
    """Sessions other than the locker's waiting on a lock for longer than `older_than_s`."""
    with admin.cursor() as cur:
        cur.execute("SELECT pid, extract(epoch FROM now() - query_start), left(query, 60) "
                    "FROM pg_stat_activity WHERE state = 'active' AND wait_event_type = 'Lock' "
                    "AND pid <> %s AND now() - query_start > make_interval(secs => %s)",
                    (locker_pid, older_than_s))
        return cur.fetchall()


def test_a_lookup_blocked_by_a_lock_is_cancelled_answered_in_bound_and_frees_its_thread(
        private_db: tuple[PrivatePostgres, Any], caplog: pytest.LogCaptureFixture) -> None:
    import psycopg2  # type: ignore[import-untyped,unused-ignore]

    from models.change_feed import ChangeFeed

    pg, db = private_db
    known_gid, known_sid = _enabled_endpoint()
    later_gid, later_sid = _enabled_endpoint()   # first looked up after the lock
    feed = ChangeFeed.for_database(db, retry_s=0.1).start()
    params = {"dbname": db.database, **db.connect_params}
    admin = psycopg2.connect(**params)
    admin.autocommit = True
    locker = psycopg2.connect(**params)
    try:
        assert feed.healthy
        cache = TargetCache(feed=feed, outage_serve_s=3600)
        assert poll(lambda: _answer(cache, known_gid, known_sid)
                    is cache.lookup(known_gid, known_sid))
        remembered = cache.lookup(known_gid, known_sid)
        assert isinstance(remembered, InvokeTarget)
        db.close()

        with locker.cursor() as cur:
            cur.execute("LOCK TABLE endpoint IN ACCESS EXCLUSIVE MODE")
        locked_at = time.monotonic()
        took = []
        # More lookups of unknown endpoints than there are lookup threads:
        # each is answered within its bound (the server is up: 503 busy),
        # none waits for a thread another lookup still holds.
        for n in range(4):
            started = time.monotonic()
            with pytest.raises(TargetsUnavailable):
                asyncio.run(cache.fetch(known_gid, "logic_" + str(n).rjust(22, "q")))
            took.append(time.monotonic() - started)
            # The feed still vouches: a remembered endpoint is answered from memory.
            assert cache.lookup(known_gid, known_sid) is remembered
        assert max(took) < BOUND_S, took
        # The server is up: no outage was declared for a lock, and the log says why once.
        assert not cache.database_down
        said = [r.getMessage() for r in caplog.records if r.name == "logic.targets"]
        assert not any("unreachable" in line for line in said), said
        assert sum("no answer within 2 s and was cancelled" in line for line in said) == 1, said
        # No query of ours waits on the lock past a few seconds (it was
        # cancelled on the server, not left behind a shut socket).
        assert time.monotonic() - locked_at > BOUND_S
        assert _waiting_on_locks(admin, locker.get_backend_pid(), BOUND_S) == []
        time.sleep(1.0)
        assert _waiting_on_locks(admin, locker.get_backend_pid(), BOUND_S) == []
    finally:
        locker.rollback()
        locker.close()
    try:
        # The lock released: the lookup threads are free, the next lookup answers at once.
        started = time.monotonic()
        later = asyncio.run(cache.fetch(later_gid, later_sid))
        assert isinstance(later, InvokeTarget) and later.enabled
        assert time.monotonic() - started < 1.0
        assert not cache.database_down
    finally:
        cache.close()
        feed.stop()
        admin.close()
