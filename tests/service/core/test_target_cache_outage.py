"""`TargetCache` while PostgreSQL is down: what the feed vouched for, and nothing stale.

Runs against a PRIVATE PostgreSQL cluster (initdb + pg_ctl on a free port,
`tests/service/http/private_servers.py`) that the test stops and starts; the
shared server is never touched. Skipped, saying why, only when the server
binaries are missing.
"""
from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from service import core
from service.core.invoke_target import NEEDS_QUERY, TargetCache, TargetsUnavailable
from tests.factories import OWNER, make_guild, make_script
from tests.service.http.harness import LOGIC
from tests.service.http.private_servers import PrivatePostgres, poll


@pytest.fixture()
def private_db() -> Iterator[tuple[PrivatePostgres, Any]]:
    from models.db import database, open_database

    pg = PrivatePostgres()
    reason = pg.missing()
    if reason:
        pytest.skip(reason)
    previous = database.obj
    try:
        pg.init().start()
        subprocess.run([LOGIC, "--database-url", pg.url, "db", "upgrade"], check=True,
                       capture_output=True)
        db = open_database(pg.url)
        database.initialize(db)
        yield pg, db
        db.close()
    finally:
        if previous is not None:
            database.initialize(previous)
        pg.cleanup()


def _answer(cache: TargetCache, gid: str, sid: str) -> Any:
    found = cache.lookup(gid, sid)
    if found is NEEDS_QUERY:
        return asyncio.run(cache.fetch(gid, sid))
    return found


def test_an_outage_serves_what_the_feed_vouched_for_and_never_a_changed_endpoint(
        private_db: tuple[PrivatePostgres, Any]) -> None:
    from models.change_feed import ChangeFeed

    pg, db = private_db
    a_gid = make_guild("pro")
    a_sid = make_script(a_gid)
    core.enable_endpoint(OWNER, a_gid, a_sid)
    b_gid = make_guild("pro")
    b_sid = make_script(b_gid)
    core.enable_endpoint(OWNER, b_gid, b_sid)
    feed = ChangeFeed.for_database(db, retry_s=0.1).start()
    try:
        assert feed.healthy
        cache = TargetCache(feed=feed)
        assert poll(lambda: _answer(cache, a_gid, a_sid) is cache.lookup(a_gid, a_sid)
                    and _answer(cache, b_gid, b_sid) is cache.lookup(b_gid, b_sid))
        assert cache.lookup(a_gid, a_sid).enabled  # type: ignore[union-attr]

        # A change commits and its notification arrives; no lookup since. The
        # remembered answers were read under the generation before it.
        before = feed.generation
        core.disable_endpoint(OWNER, a_gid, a_sid)
        assert poll(lambda: feed.generation not in (None, before))
        db.close()
        pg.stop("fast")
        assert poll(lambda: feed.vouched_until is not None)
        # A's remembered answer predates its change: never served, even now;
        # nor anything else read under that older generation.
        with pytest.raises(TargetsUnavailable):
            _answer(cache, a_gid, a_sid)
        with pytest.raises(TargetsUnavailable):
            _answer(cache, b_gid, b_sid)

        pg.start()
        # Back: the feed's reconnect starts a new generation; A is read afresh.
        assert poll(lambda: feed.healthy, 30)
        assert poll(lambda: _try(cache, a_gid, a_sid) is False, 30)
        b = _answer(cache, b_gid, b_sid)
        assert b.enabled and cache.lookup(b_gid, b_sid) is b

        # A second outage with nothing changed before it: what was read under
        # the generation the feed vouched for up to the break is served.
        db.close()
        pg.stop("fast")
        assert poll(lambda: feed.vouched_until is not None)
        assert _answer(cache, b_gid, b_sid) is b
        assert _answer(cache, b_gid, b_sid) is b
        with pytest.raises(TargetsUnavailable):   # never looked up: nothing to serve
            _answer(cache, a_gid, "logic_" + "z" * 22)
    finally:
        feed.stop()


def _try(cache: TargetCache, gid: str, sid: str) -> bool | None:
    """A's `enabled` as the cache answers it, None while it cannot answer yet."""
    try:
        target = _answer(cache, gid, sid)
    except TargetsUnavailable:
        return None
    return None if target is None else bool(target.enabled)
