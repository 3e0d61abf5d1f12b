"""Migrations on SQLite and PostgreSQL: from empty and from every earlier
version, idempotence, down/up, and the live models matching the migrated
schema."""
from __future__ import annotations

import pytest

from models import ALL_MODELS
from models.clock import utcnow
from models.db import connect, database, open_database
from models.migrate import HISTORY_TABLE, Runner, SchemaBehindError, discover, latest_version

LATEST = latest_version()
#: A kept version's source in a seeded database: more UTF-8 bytes than characters.
OLD_SOURCE = "on endpoint(e):\n    pass  # é€\n"
#: Shipped versions in order (numbers are reserved per branch, so there may be gaps).
VERSIONS = [m.version for m in discover()]


def _seed(db, version: int) -> None:
    """Rows a database at `version` could hold, written with plain SQL (the
    live models may not match an old schema)."""
    p = db.param
    now = utcnow()
    db.execute_sql(f"INSERT INTO guild (id, owner_id, plan, created_at) VALUES ({p},{p},{p},{p})",
                   ("42", "7", "pro", now))
    db.execute_sql(f"INSERT INTO script (public_id, guild_id, name, source, version, created_at, "
                   f"updated_at) VALUES ({p},{p},{p},{p},{p},{p},{p})",
                   ("logic_" + "x" * 22, "42", "old", "on endpoint(e):\n    pass\n", 3, now, now))
    db.execute_sql(f"INSERT INTO endpoint (script_id, enabled, whitelist, created_at) "
                   f"VALUES ((SELECT id FROM script), {p}, {p}, {p})", (True, "[]", now))
    if version >= 2:
        # From 0005 on, a bucket counts queued and deprioritised requests, from
        # 0006 on its test calls (NOT NULL columns).
        extra = ("", "")
        if version >= 5:
            extra = (", queued, deprioritised", ", 0, 0")
        if version >= 6:
            extra = (extra[0] + ", test_count", extra[1] + ", 0")
        db.execute_sql(f"INSERT INTO stat_bucket (endpoint_id, granularity, start, status, count, "
                       f"duration_sum, h0, h1, h2, h3, h4, h5, h6, h7, h8, h9, h10, h11{extra[0]}) "
                       f"VALUES ((SELECT id FROM endpoint), 'h', {p}, 200, 1, 1.0, "
                       f"1,0,0,0,0,0,0,0,0,0,0,0{extra[1]})",
                       (now.replace(minute=0, second=0, microsecond=0),))
    if 8 <= version < 11:
        db.execute_sql(f"INSERT INTO script_version (script_id, version, source, author, "
                       f"created_at) VALUES ((SELECT id FROM script), 3, {p}, 'operator', {p})",
                       (OLD_SOURCE, now))
    elif version >= 11:   # a release that knows the size writes it
        db.execute_sql(f"INSERT INTO script_version (script_id, version, source, author, "
                       f"created_at, source_bytes) VALUES ((SELECT id FROM script), 3, {p}, "
                       f"'operator', {p}, {p})", (OLD_SOURCE, now, len(OLD_SOURCE.encode("utf-8"))))


def test_there_are_several_versions():
    assert LATEST >= 2


def test_a_migration_below_the_newest_applied_one_is_still_applied(db_url):
    """Numbers are reserved per line of work: a database may hold a newer
    migration without an older one merged later.  `check` refuses it and
    `upgrade` applies exactly the missing one."""
    db = connect(db_url)
    runner = Runner(db)
    runner.upgrade()
    missing = discover()[-2]
    with db.atomic():
        missing.module.down(db)
        db.execute_sql(f"DELETE FROM {HISTORY_TABLE} WHERE version = {missing.version}")
    with pytest.raises(SchemaBehindError) as err:
        runner.check()
    assert f"at version {VERSIONS[-3]}, this release needs {LATEST}" in str(err.value)
    assert runner.upgrade() == [missing.version]
    runner.check()
    db.close()
    database.initialize(None)


def test_empty_database_upgrades_and_is_idempotent(db_url):
    db = connect(db_url)
    runner = Runner(db)
    assert runner.current_version() == 0
    with pytest.raises(SchemaBehindError) as err:
        runner.check()
    assert str(err.value) == (f'database schema is at version 0, this release needs {LATEST}: '
                              f'run "logic db upgrade"')
    assert runner.upgrade() == VERSIONS
    assert runner.upgrade() == []
    runner.check()
    extra = {HISTORY_TABLE} | ({"target_generation"} if db_url.startswith("sqlite") else set())
    assert set(db.get_tables()) == {m._meta.table_name for m in ALL_MODELS} | extra
    db.close()
    database.initialize(None)


@pytest.mark.parametrize("start", VERSIONS[:-1])
def test_upgrade_from_every_earlier_version(db_url, start):
    db = connect(db_url)
    runner = Runner(db)
    runner.upgrade(start)
    assert runner.current_version() == start
    _seed(db, start)
    with pytest.raises(SchemaBehindError):
        runner.check()
    assert runner.upgrade() == [v for v in VERSIONS if v > start]
    runner.check()
    from models import Endpoint, Guild, Script
    script = Script.get()
    assert (Guild.get().plan, script.version, Endpoint.get().enabled) == ("pro", 3, True)
    if start >= 8:     # 0011 sized the versions already kept
        from models import ScriptVersion
        assert ScriptVersion.get().source_bytes == len(OLD_SOURCE.encode("utf-8")) == 34
        # A node of the release before, which does not know the column, still
        # saves a version during a rolling upgrade (the database's default).
        p = db.param
        db.execute_sql(f"INSERT INTO script_version (script_id, version, source, author, "
                       f"created_at) VALUES ((SELECT id FROM script), 4, {p}, 'operator', {p})",
                       (OLD_SOURCE, utcnow()))
        assert ScriptVersion.get(ScriptVersion.version == 4).source_bytes == 0
    db.close()
    database.initialize(None)


def test_down_to_zero_and_up_again(db_url):
    db = connect(db_url)
    runner = Runner(db)
    runner.upgrade()
    assert runner.downgrade(0) == VERSIONS[::-1]
    assert set(db.get_tables()) == {HISTORY_TABLE}
    assert runner.upgrade() == VERSIONS
    db.close()
    database.initialize(None)


def _shape(db) -> dict[str, tuple]:
    out = {}
    # Tables the migrations keep outside the models: their own history, and
    # SQLite's lookup generation (written by triggers only, read by raw SQL).
    for table in sorted(t for t in db.get_tables() if t not in (HISTORY_TABLE, "target_generation")):
        columns = tuple(sorted((c.name, c.data_type.lower(), c.null) for c in db.get_columns(table)))
        indexes = tuple(sorted((tuple(i.columns), i.unique) for i in db.get_indexes(table)))
        out[table] = (columns, indexes)
    return out


def test_live_models_match_the_migrated_schema(db_url, tmp_path):
    migrated = connect(db_url)
    Runner(migrated).upgrade()
    expected = _shape(migrated)
    migrated.close()
    fresh_url = f"sqlite:///{tmp_path}/fresh.db"
    if db_url.startswith("postgres"):
        # A second empty schema: reuse the URL's search_path with another name.
        fresh_url = db_url.replace("search_path%3D", "search_path%3Dfresh_")
        admin = open_database(db_url)
        schema = db_url.rsplit("search_path%3D", 1)[1]
        admin.execute_sql(f'CREATE SCHEMA "fresh_{schema}"')
    fresh = connect(fresh_url)
    fresh.create_tables(ALL_MODELS)
    actual = _shape(fresh)
    fresh.close()
    if db_url.startswith("postgres"):
        admin.execute_sql(f'DROP SCHEMA "fresh_{schema}" CASCADE')
        admin.close()
    database.initialize(None)
    assert actual == expected


def test_concurrent_upgrades_apply_each_migration_once(db_url):
    """Two runners at once (e.g. two nodes starting): one applies, one waits."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    db = connect(db_url)
    barrier = threading.Barrier(2)

    def upgrade(_: int) -> list[int]:
        barrier.wait()
        try:
            return Runner(db).upgrade()
        finally:
            db.close()

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(upgrade, range(2)))
    assert sorted(v for r in results for v in r) == VERSIONS
    assert Runner(db).current_version() == LATEST
    rows = db.execute_sql(f"SELECT COUNT(*) FROM {HISTORY_TABLE}").fetchone()[0]
    assert rows == len(VERSIONS)
    db.close()
    database.initialize(None)


def test_sqlite_counts_every_change_of_what_a_lookup_reads(db_url):
    """0012: every insert, update and delete of a guild, script or endpoint row
    adds one to `target_generation.n` (the endpoint cache keeps its answers
    while it stays); other tables' writes do not; `down` removes it all."""
    from service.core.target_generation import TRIGGERS, generation
    db = connect(db_url)
    Runner(db).upgrade()
    if not db_url.startswith("sqlite"):
        # PostgreSQL's change feed notifies these changes (0004, 0009): nothing here.
        assert "target_generation" not in db.get_tables()
        db.close()
        database.initialize(None)
        return
    conn = db.connection()
    first = generation(conn)
    assert first is not None and len(TRIGGERS) == 9
    _seed(db, LATEST)   # a guild, a script, an endpoint and statistics: 3 inserts
    n = first[0] + 3
    assert generation(conn) == (n, first[1])
    steps = ["UPDATE guild SET plan = 'free'", "UPDATE script SET name = 'x'",
             "UPDATE endpoint SET enabled = 0", "DELETE FROM endpoint", "DELETE FROM script",
             "DELETE FROM guild"]
    for sql in steps:
        db.execute_sql(sql)
        n += 1
        assert generation(conn) == (n, first[1]), sql
    db.execute_sql("DELETE FROM stat_bucket")        # no lookup reads it
    assert generation(conn) == (n, first[1])
    db.execute_sql("DROP TRIGGER logic_generation_endpoint_update")
    assert generation(conn) is None                  # one missing: it vouches for nothing
    assert Runner(db).downgrade(11)[-1] == 12   # (and those after it)
    assert "target_generation" not in db.get_tables()
    assert not db.execute_sql("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall()
    db.close()
    database.initialize(None)
