"""`TargetCache`: the invoke path's lookup, remembered on SQLite, never stale.

On SQLite a repeated lookup is answered from memory until another connection
commits (`PRAGMA data_version`); on PostgreSQL every lookup reads the database.
Changes are made the way they happen in production: through the service layer
from another thread (peewee gives it its own connection, as the record writer
or an admin request has), or through a second raw `sqlite3` connection (as the
`logic` CLI in another process would).
"""
from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from typing import Any, TypeVar

import pytest

from service import core
from service.core.invoke_target import InvokeTarget, TargetCache, load_target
from service.core.secrets import verify_secret
from tests.factories import OWNER, make_guild, make_script

T = TypeVar("T")

SQLITE_ONLY = pytest.mark.parametrize("db", ["sqlite"], indirect=True)
POSTGRES_ONLY = pytest.mark.parametrize("db", ["postgresql"], indirect=True)


def in_other_thread(db, fn: Callable[[], T]) -> T:
    """Run `fn` in a new thread, on that thread's own database connection."""
    def run() -> T:
        try:
            return fn()
        finally:
            db.close()  # closes this thread's connection only
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result(timeout=30)


def sqlite_write(db, sql: str, params: tuple[Any, ...]) -> None:
    """Commit `sql` through a second, raw connection to the same file."""
    with closing(sqlite3.connect(db.database, timeout=10)) as conn:
        with conn:
            assert conn.execute(sql, params).rowcount == 1


def count_queries(monkeypatch, db) -> list[str]:
    """Record every `execute_sql` on `db` (the lookup's query goes through it;
    the cache's own PRAGMA does not)."""
    seen: list[str] = []
    real = db.execute_sql

    def counting(sql, *args, **kwargs):
        seen.append(sql)
        return real(sql, *args, **kwargs)
    monkeypatch.setattr(db, "execute_sql", counting)
    return seen


def must(target: InvokeTarget | None) -> InvokeTarget:
    assert target is not None
    return target


@pytest.fixture
def endpoint(db) -> tuple[str, str]:
    """An enabled endpoint on a pro guild: (guild id, script id)."""
    gid = make_guild("pro")
    sid = make_script(gid)
    core.enable_endpoint(OWNER, gid, sid)
    return gid, sid


@SQLITE_ONLY
def test_sqlite_repeated_lookup_is_served_from_memory(db, endpoint, monkeypatch):
    gid, sid = endpoint
    cache = TargetCache()
    queries = count_queries(monkeypatch, db)
    first = must(cache(gid, sid))
    assert len(queries) == 1
    again = cache(gid, sid)
    assert again is first and len(queries) == 1
    assert first == load_target(gid, sid)
    assert first.enabled is True and first.guild_id == gid and first.script_id == sid


@SQLITE_ONLY
def test_sqlite_change_from_another_thread_is_seen_by_the_next_lookup(db, endpoint):
    gid, sid = endpoint
    cache = TargetCache()
    before = must(cache(gid, sid))
    assert before.secret_hash is None
    assert cache(gid, sid) is before

    secret = in_other_thread(db, lambda: core.regenerate_secret(OWNER, gid, sid))["secret"]
    after = must(cache(gid, sid))
    assert after.secret_hash is not None and verify_secret(after.secret_hash, secret)
    assert cache(gid, sid) is after  # remembered again until the next change

    again = in_other_thread(db, lambda: core.regenerate_secret(OWNER, gid, sid))["secret"]
    latest = must(cache(gid, sid))
    assert verify_secret(latest.secret_hash, again) and not verify_secret(latest.secret_hash, secret)

    in_other_thread(db, lambda: core.disable_endpoint(OWNER, gid, sid))
    assert must(cache(gid, sid)).enabled is False


@SQLITE_ONLY
def test_sqlite_change_from_another_connection_is_seen_by_the_next_lookup(db, endpoint):
    gid, sid = endpoint
    cache = TargetCache()
    assert must(cache(gid, sid)).enabled is True
    sqlite_write(db, "UPDATE endpoint SET enabled = 0 WHERE id = ?",
                 (must(load_target(gid, sid)).endpoint_id,))
    assert must(cache(gid, sid)).enabled is False

    sqlite_write(db, "UPDATE script SET source = ?, version = version + 1 WHERE public_id = ?",
                 ("on endpoint(event):\n    pass\n", sid))
    changed = must(cache(gid, sid))
    assert changed.script_version == 2 and "pass" in changed.source


@SQLITE_ONLY
def test_sqlite_remembered_not_found_is_dropped_on_change(db, endpoint):
    """A remembered None (unknown script) is not stale either."""
    gid, sid = endpoint
    cache = TargetCache()
    renamed = "logic_" + "z" * 22
    assert cache(gid, renamed) is None
    assert cache(gid, renamed) is None
    sqlite_write(db, "UPDATE script SET public_id = ? WHERE public_id = ?", (renamed, sid))
    assert must(cache(gid, renamed)).script_id == renamed
    assert cache(gid, sid) is None


def test_unknown_endpoints_return_none_and_memory_stays_bounded(db, endpoint):
    gid, sid = endpoint
    cache = TargetCache(max_entries=8)
    for n in range(100):
        assert cache(gid, f"logic_{n:022d}") is None
        assert cache(str(900_000 + n), sid) is None
        assert cache("not-a-guild", f"bad{n}") is None
    # Reading the private dict: the bound on memory is what is tested here,
    # and nothing public exposes it.
    assert len(cache._entries) <= 8
    assert must(cache(gid, sid)).enabled is True  # known endpoints still resolve
    assert len(cache._entries) <= 8


@SQLITE_ONLY
def test_invalidate_drops_entries(db, endpoint):
    gid, sid = endpoint
    cache = TargetCache()
    first = must(cache(gid, sid))
    assert cache(gid, "logic_" + "y" * 22) is None
    assert len(cache._entries) == 2  # private dict, read to see what is remembered
    # A write through this thread's own connection need not move what the
    # cache watches (the pragma, where it answers, ignores the connection's own
    # commits); the documented contract is that such a writer invalidates.
    core.disable_endpoint(OWNER, gid, sid)
    cache.invalidate()
    assert cache._entries == {}
    fresh = must(cache(gid, sid))
    assert fresh is not first and fresh.enabled is False


@POSTGRES_ONLY
def test_postgresql_every_lookup_reads_the_database(db, endpoint, monkeypatch):
    gid, sid = endpoint
    cache = TargetCache()
    queries = count_queries(monkeypatch, db)
    first = must(cache(gid, sid))
    second = must(cache(gid, sid))
    assert first == second and first is not second
    assert len(queries) == 2
    assert cache._entries == {}  # private dict: nothing is remembered on PostgreSQL

    # Changes through this thread's connection and through another thread's
    # are both seen at once, without invalidate().
    core.disable_endpoint(OWNER, gid, sid)
    assert must(cache(gid, sid)).enabled is False
    secret = in_other_thread(db, lambda: core.regenerate_secret(OWNER, gid, sid))["secret"]
    assert verify_secret(must(cache(gid, sid)).secret_hash, secret)


@SQLITE_ONLY
def test_sqlite_reconnect_does_not_serve_a_stale_answer(db, endpoint):
    # data_version values compare only within one connection: a reconnect
    # starts a new series that can repeat the old value.
    gid, sid = endpoint
    cache = TargetCache()
    assert must(cache(gid, sid)).enabled
    db.close()
    sqlite_write(db, "UPDATE endpoint SET enabled = 0 WHERE id = ?",
                 (must(load_target(gid, sid)).endpoint_id,))
    db.close()
    db.connect()
    assert not must(cache(gid, sid)).enabled


# ------------------------------------------------ PostgreSQL: LISTEN/NOTIFY
def _wait(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def _terminate_listener(db) -> int:
    """Kill the feed's backend the way an operator or a failover would."""
    import psycopg2
    from models.change_feed import APPLICATION_NAME
    params = {"dbname": db.database, **db.connect_params}
    with closing(psycopg2.connect(**params)) as admin:
        admin.autocommit = True
        with admin.cursor() as cur:
            cur.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                        (f"{APPLICATION_NAME}/{os.getpid()}",))
            pids = [row[0] for row in cur.fetchall()]
            for pid in pids:
                cur.execute("SELECT pg_terminate_backend(%s)", (pid,))
    return len(pids)


@pytest.fixture
def feed(db):
    from models.change_feed import ChangeFeed
    f = ChangeFeed.for_database(db).start()
    assert f.healthy, "the feed should be listening within its start-up wait"
    yield f
    f.stop()


@POSTGRES_ONLY
def test_postgresql_with_a_feed_lookups_are_remembered_until_a_commit(db, endpoint, feed,
                                                                      monkeypatch):
    gid, sid = endpoint
    cache = TargetCache(feed=feed)
    queries = count_queries(monkeypatch, db)
    first = must(cache(gid, sid))
    assert must(cache(gid, sid)) is first and len(queries) == 1   # from memory

    # A commit from another connection (another node, the CLI) notifies; the
    # very next lookup after the notification arrived reads the new row.
    before = feed.generation
    secret = in_other_thread(db, lambda: core.regenerate_secret(OWNER, gid, sid))["secret"]
    assert _wait(lambda: feed.generation not in (None, before))
    assert verify_secret(must(cache(gid, sid)).secret_hash, secret)
    assert len([q for q in queries if q.startswith('SELECT "t1"."version"')]) == 2

    core.disable_endpoint(OWNER, gid, sid)                 # this thread's own connection
    assert _wait(lambda: must(cache(gid, sid)).enabled is False)


@POSTGRES_ONLY
def test_postgresql_a_feed_hears_only_the_changes_of_its_own_schema(db, pg_empty_url):
    # Another installation in another schema of the same database (its own
    # search_path): its changes and revocations must not empty this one's
    # caches (with one channel per database they did, on every change), while
    # this schema's own still do.
    import time
    from models.change_feed import CHANNEL, TOKENS_CHANNEL, ChangeFeed, schema_suffix
    from models.db import connect
    from models.migrate import Runner
    from service.core.tokens import REVOKED_NOTIFY_SQL
    other = connect(pg_empty_url)
    try:
        Runner(other).upgrade()
        feed = ChangeFeed.for_database(db, channels=(CHANNEL, TOKENS_CHANNEL)).start()
        try:
            schema = db.execute_sql("SELECT current_schema()").fetchone()[0]
            assert feed.healthy and feed.suffix == schema_suffix(schema)
            before = feed.generation
            # A statement-level trigger fires even when no row changes.
            other.execute_sql('DELETE FROM "endpoint" WHERE id < 0')
            other.execute_sql(REVOKED_NOTIFY_SQL, (TOKENS_CHANNEL + "_",))
            time.sleep(0.5)                     # far more than a delivery on one host
            assert feed.generation == before
            db.execute_sql('DELETE FROM "endpoint" WHERE id < 0')
            assert _wait(lambda: feed.generation not in (None, before))
            moved = feed.generation
            db.execute_sql(REVOKED_NOTIFY_SQL, (TOKENS_CHANNEL + "_",))
            assert _wait(lambda: feed.generation not in (None, moved))
            # A node of the release before (during a rolling upgrade) revokes on
            # the unscoped channel only: still heard.
            moved = feed.generation
            other.execute_sql(f"NOTIFY {TOKENS_CHANNEL}")
            assert _wait(lambda: feed.generation not in (None, moved))
        finally:
            feed.stop()
    finally:
        other.close()


@POSTGRES_ONLY
def test_postgresql_a_feed_still_hears_changes_after_the_schema_is_downgraded(db, pg_empty_url):
    # A downgrade below 0009 runs while nodes of this release may still serve
    # (the release before refuses to start until it is done): they listen only
    # to the scoped channel, so it must keep being notified.
    from models.change_feed import ChangeFeed
    from models.db import connect
    from models.migrate import Runner
    other = connect(pg_empty_url)
    try:
        Runner(other).upgrade()
        feed = ChangeFeed.for_database(other).start()
        try:
            assert feed.healthy
            Runner(other).downgrade(8)
            before = feed.generation
            other.execute_sql('DELETE FROM "endpoint" WHERE id < 0')
            assert _wait(lambda: feed.generation not in (None, before))
        finally:
            feed.stop()
    finally:
        other.close()


@POSTGRES_ONLY
def test_postgresql_a_lost_feed_means_querying_never_stale(db, endpoint, feed, monkeypatch):
    gid, sid = endpoint
    cache = TargetCache(feed=feed)
    assert must(cache(gid, sid)).enabled
    assert _terminate_listener(db) >= 1
    assert _wait(lambda: not feed.healthy or feed.reconnects > 1)

    # While the feed is down (or just back), a change is never hidden by the
    # remembered answer: the cache either queries or starts a new generation.
    core.disable_endpoint(OWNER, gid, sid)
    assert must(cache(gid, sid)).enabled is False
    assert _wait(lambda: feed.healthy and feed.reconnects > 1)
    core.enable_endpoint(OWNER, gid, sid)
    assert _wait(lambda: must(cache(gid, sid)).enabled is True)


@POSTGRES_ONLY
def test_postgresql_a_lost_feed_is_never_trusted_again_when_its_descriptor_number_is_reused(
        db, endpoint, feed, monkeypatch):
    """libpq closes the feed's socket when it reads the server's goodbye; until
    the feed's thread marks the loss, a new descriptor (a client's connection,
    a lookup thread's reconnect) may take that number. It must never pass for
    the feed's socket and make the cache trust answers the feed no longer
    vouches for."""
    import socket
    gid, sid = endpoint
    cache = TargetCache(feed=feed)
    assert must(cache(gid, sid)).enabled
    fd = feed._conn.fileno()
    release = threading.Event()
    noticed = feed._lost
    monkeypatch.setattr(feed, "_lost", lambda: (release.wait(30), noticed()))
    taken: list[tuple[Any, Any]] = []
    try:
        assert _terminate_listener(db) >= 1
        # libpq read the goodbye and closed its descriptor; the loss is not marked yet.
        assert _wait(lambda: not os.path.exists(f"/proc/self/fd/{fd}")), "libpq closed it"
        assert feed.healthy
        while not any(s.fileno() == fd for pair in taken for s in pair) and len(taken) < 64:
            taken.append(socket.socketpair())   # lowest free numbers first: takes fd
        assert any(s.fileno() == fd for pair in taken for s in pair)
        assert feed.generation is None, "a reused descriptor number passed for the feed's"
        core.disable_endpoint(OWNER, gid, sid)
        assert must(cache(gid, sid)).enabled is False
    finally:
        release.set()
        for pair in taken:
            for s in pair:
                s.close()


@POSTGRES_ONLY
def test_postgresql_feed_down_every_lookup_queries(db, endpoint, monkeypatch):
    from models.change_feed import ChangeFeed
    # A feed that can never connect (wrong port) never vouches for anything.
    params = {"dbname": db.database, **db.connect_params, "port": 1, "connect_timeout": 1}
    dead = ChangeFeed(params, retry_s=0.05).start(wait_s=0.2)
    try:
        gid, sid = endpoint
        cache = TargetCache(feed=dead)
        queries = count_queries(monkeypatch, db)
        must(cache(gid, sid))
        must(cache(gid, sid))
        assert dead.generation is None and len(queries) == 2 and cache._entries == {}
    finally:
        dead.stop()


@SQLITE_ONLY
def test_sqlite_a_commit_that_changes_no_lookup_keeps_the_answers(db, endpoint, monkeypatch):
    """The records writer's commits (history, statistics) move the WAL header
    but no guild, script or endpoint row: the answers stay (`target_generation`)."""
    gid, sid = endpoint
    cache = TargetCache()
    first = must(cache(gid, sid))
    unknown = "logic_" + "q" * 22
    assert cache(gid, unknown) is None
    queries = count_queries(monkeypatch, db)
    for _ in range(3):
        sqlite_write(db, "UPDATE script_version SET author = author || '.' WHERE script_id = "
                         "(SELECT id FROM script WHERE public_id = ?)", (sid,))
        assert cache(gid, sid) is first and cache(gid, unknown) is None
    assert queries == []
    # A change of what a lookup reads is still seen at once, and a new script too.
    sqlite_write(db, "UPDATE endpoint SET enabled = 0 WHERE id = ?", (first.endpoint_id,))
    assert must(cache(gid, sid)).enabled is False
    sqlite_write(db, "UPDATE script SET public_id = ? WHERE public_id = ?", (unknown, sid))
    assert must(cache(gid, unknown)).script_id == unknown and cache(gid, sid) is None


@SQLITE_ONLY
def test_sqlite_a_change_made_while_a_trigger_was_missing_is_seen(db, endpoint):
    """The generation vouches only with every trigger in place, and any trigger
    dropped and made again moves the schema cookie it is read with."""
    from service.core.target_generation import generation
    gid, sid = endpoint
    cache = TargetCache()
    endpoint_id = must(cache(gid, sid)).endpoint_id
    with closing(sqlite3.connect(db.database, timeout=10)) as conn:
        made = conn.execute("SELECT sql FROM sqlite_master WHERE name = ?",
                            ("logic_generation_endpoint_update",)).fetchone()[0]
        with conn:
            conn.execute("DROP TRIGGER logic_generation_endpoint_update")
        assert generation(conn) is None
        with conn:   # no trigger counts this one
            conn.execute("UPDATE endpoint SET enabled = 0 WHERE id = ?", (endpoint_id,))
        assert must(cache(gid, sid)).enabled is False   # every commit drops the answers now
        with conn:
            conn.execute("UPDATE endpoint SET enabled = 1 WHERE id = ?", (endpoint_id,))
            conn.execute(made)
        assert generation(conn) is not None
    assert must(cache(gid, sid)).enabled is True
    # Dropped, a change, made again, all between two lookups: still seen.
    with closing(sqlite3.connect(db.database, timeout=10)) as conn:
        with conn:
            conn.execute("DROP TRIGGER logic_generation_endpoint_update")
        with conn:
            conn.execute("UPDATE endpoint SET enabled = 0 WHERE id = ?", (endpoint_id,))
        with conn:
            conn.execute(made)
    assert must(cache(gid, sid)).enabled is False


def _changed_schema_vouches_for_nothing(db, endpoint, statements: list[str]) -> None:
    """After `statements` (committed by another connection) the generation
    vouches for nothing, so a later change of the endpoint is seen at once."""
    from service.core.target_generation import generation
    gid, sid = endpoint
    cache = TargetCache()
    endpoint_id = must(cache(gid, sid)).endpoint_id
    with closing(sqlite3.connect(db.database, timeout=10)) as conn:
        with conn:
            for statement in statements:
                conn.execute(statement)
        assert generation(conn) is None
    assert must(cache(gid, sid)).enabled is True
    sqlite_write(db, "UPDATE endpoint SET enabled = 0 WHERE id = ?", (endpoint_id,))
    assert must(cache(gid, sid)).enabled is False


@SQLITE_ONLY
def test_sqlite_a_table_renamed_away_with_its_triggers_vouches_for_nothing(db, endpoint):
    """A table renamed takes its triggers along: nine triggers still exist by
    name, but none counts a change of the table now called `endpoint`."""
    with closing(sqlite3.connect(db.database)) as conn:
        made = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'endpoint'").fetchone()[0]
    _changed_schema_vouches_for_nothing(db, endpoint, [
        "PRAGMA legacy_alter_table = ON",   # leave other tables' references alone
        "ALTER TABLE endpoint RENAME TO endpoint_old",
        made,
        "INSERT INTO endpoint SELECT * FROM endpoint_old"])


@SQLITE_ONLY
def test_sqlite_a_trigger_made_again_that_no_longer_counts_vouches_for_nothing(db, endpoint):
    """A trigger dropped and made again under its own name must also be the
    same trigger: one that no longer adds to the generation does not vouch."""
    _changed_schema_vouches_for_nothing(db, endpoint, [
        "DROP TRIGGER logic_generation_endpoint_update",
        "CREATE TRIGGER logic_generation_endpoint_update AFTER UPDATE ON \"endpoint\" WHEN 0 "
        "BEGIN UPDATE target_generation SET n = n + 1 WHERE id = 1; END"])


@POSTGRES_ONLY
def test_postgresql_a_notification_read_before_a_slow_heartbeat_is_never_outrun(db, endpoint):
    """Outside review, session 21: the feed's thread read a notification off its
    socket and, a heartbeat being due, ran the heartbeat's round trip before
    counting it. For that round trip the socket was empty and the generation
    old, so the old answer was served (a disabled endpoint, a regenerated
    secret; up to the heartbeat's timeout on a loaded server). Here the
    heartbeat takes 0.5 s whenever it starts with a notification read but not
    yet counted (a loaded backend answering slowly, at the moment that
    matters), and the endpoint is changed while a heartbeat is overdue: the
    thread waits 0.25 s at a time, so a notification that ends a wait finds
    the heartbeat due. (A busy host can shift the change out of that window:
    up to five tries, each a failure if it met the window and the old
    answer was served after the notification reached the thread.)"""
    import time as _time
    from models.change_feed import ChangeFeed
    gid, sid = endpoint
    endpoint_id = must(load_target(gid, sid)).endpoint_id
    feed = ChangeFeed.for_database(db, heartbeat_s=0.3, heartbeat_timeout_s=2.0)
    real = feed._heartbeat
    beats: list[float] = []
    slowed: list[float] = []

    def heartbeat(conn: Any) -> None:
        if conn.notifies:
            slowed.append(_time.monotonic())
            _time.sleep(0.5)
        real(conn)
        beats.append(_time.monotonic())

    def set_enabled(on: bool) -> None:
        in_other_thread(db, lambda: db.execute_sql(
            "UPDATE endpoint SET enabled = %s WHERE id = %s", (on, endpoint_id)))

    feed._heartbeat = heartbeat  # type: ignore[method-assign]
    feed.start()
    try:
        assert feed.healthy
        cache = TargetCache(feed=feed)
        for attempt in range(5):
            enabled = attempt % 2 == 0       # what the change below turns it from
            assert _wait(lambda: must(cache(gid, sid)).enabled is enabled)
            generation, seen = feed.generation, len(beats)
            assert _wait(lambda: len(beats) > seen, timeout=5)
            # 0.35 s after a heartbeat: the next is due, the thread waits until 0.5 s.
            _time.sleep(max(0.0, beats[-1] + 0.35 - _time.monotonic()))
            met = len(slowed)
            set_enabled(not enabled)
            # Once the notification reached the thread (it read it, or the
            # generation moved), the old answer is never served again.
            assert _wait(lambda: len(slowed) > met or feed.generation != generation, timeout=5)
            if len(slowed) == met:
                continue                     # the window was missed: try again
            end = _time.monotonic() + 0.4
            while _time.monotonic() < end:
                assert must(cache(gid, sid)).enabled is not enabled, "the old answer was served"
                _time.sleep(0.002)
            return
        pytest.fail("the change never met a due heartbeat in five tries: nothing was tested")
    finally:
        feed.stop()


@POSTGRES_ONLY
def test_postgresql_a_stalled_listening_backend_stops_the_feed_vouching(db, endpoint):
    """Outside review, session 19: a feed whose connection stays up while its
    backend stops (a stuck backend, a proxy that keeps the client side open)
    vouched forever, and a regenerated secret stayed valid on that node. The
    heartbeat query stops the vouching within its timeout, then shuts the
    connection down, and the feed listens again on a new one."""
    import signal
    from models.change_feed import APPLICATION_NAME, ChangeFeed
    gid, sid = endpoint
    feed = ChangeFeed.for_database(db, heartbeat_s=0.2, heartbeat_timeout_s=0.3).start()
    try:
        assert feed.healthy and feed.generation is not None
        cache = TargetCache(feed=feed)
        must(cache(gid, sid))
        name = f"{APPLICATION_NAME}/{os.getpid()}"
        backend = db.execute_sql("SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                                 (name,)).fetchone()[0]
        os.kill(backend, signal.SIGSTOP)
        try:
            # What it remembered is not served once the heartbeat went unanswered.
            assert _wait(lambda: feed.generation is None, timeout=5)
            secret = in_other_thread(db, lambda: core.regenerate_secret(OWNER, gid, sid))["secret"]
            assert verify_secret(must(cache(gid, sid)).secret_hash, secret)
            # Cut off and made again, on a new backend, while the old one is still stopped.
            assert _wait(lambda: feed.generation is not None and feed.reconnects >= 2, timeout=10)
            assert verify_secret(must(cache(gid, sid)).secret_hash, secret)
        finally:
            os.kill(backend, signal.SIGCONT)
    finally:
        feed.stop()
