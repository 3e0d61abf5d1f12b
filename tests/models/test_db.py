"""`connect(url)`: backend choice, SQLite pragmas, PostgreSQL reconnects."""
from __future__ import annotations

import pytest
from peewee import PostgresqlDatabase, SqliteDatabase

from models import Guild
from models.db import DatabaseURLError, connect, database, open_database
from models.migrate import Runner


def test_sqlite_url_and_pragmas(tmp_path):
    db = connect(f"sqlite:///{tmp_path}/x.db")
    assert isinstance(db, SqliteDatabase) and db.database == f"{tmp_path}/x.db"
    assert db.execute_sql("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute_sql("PRAGMA foreign_keys").fetchone()[0] == 1
    assert db.execute_sql("PRAGMA busy_timeout").fetchone()[0] == 10000
    db.close()
    database.initialize(None)


@pytest.mark.parametrize("url", ["mysql://x/y", "sqlite://", "postgresql://host/", "nonsense"])
def test_bad_urls(url):
    with pytest.raises(DatabaseURLError):
        open_database(url)


@pytest.mark.parametrize("url", ["postgresql://logic:S3cretPw@127.0.0.1:1",
                                 "postgresql://logic:S3cretPw@db.internal:5432/",
                                 "sqlite://u:S3cretPw@", "mysql://a:S3cretPw@h/db",
                                 # Session 24: a `/`, `?` or `#` in the password
                                 # (not percent-encoded) put part of it where the
                                 # port goes, and the port's error quoted it.
                                 "postgresql://logic:S3cretPw/x@h:5432/db",
                                 "postgresql://logic:S3cretPw?x@h/db",
                                 "postgresql://logic:S3cretPw#x@h:5432/db",
                                 "postgresql://logic:[S3cretPw]/x@h:5432/db"])
def test_a_bad_urls_message_never_holds_its_password(url):
    # Red-team pass, session 23: the message quoted the whole URL, so a URL
    # missing only its database name printed the password (also into the
    # journal of a service started by systemd).
    with pytest.raises(DatabaseURLError) as err:
        open_database(url)
    assert "S3cretPw" not in str(err.value) and "database url" in str(err.value)


def test_postgres_url_parts():
    db = open_database("postgresql://u:p%40ss@h:5433/name?sslmode=require&connect_timeout=3")
    assert isinstance(db, PostgresqlDatabase) and db.database == "name"
    assert db.connect_params == {"user": "u", "password": "p@ss", "host": "h", "port": 5433,
                                 "sslmode": "require", "connect_timeout": 3,
                                 # TCP keepalives unless the URL says otherwise
                                 "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
                                 "keepalives_count": 3, "tcp_user_timeout": 10000}


def test_keepalive_parameters_of_the_url_win_over_the_defaults_and_the_feeds():
    from models.change_feed import ChangeFeed
    db = open_database("postgresql://u@h/name?keepalives_idle=30&tcp_user_timeout=0")
    assert db.connect_params["keepalives_idle"] == 30 and db.connect_params["tcp_user_timeout"] == 0
    assert db.connect_params["keepalives_count"] == 3
    feed = ChangeFeed.for_database(db)
    # The change feed's own, quicker values, except where the URL set one.
    assert feed._connect_kwargs["keepalives_idle"] == 30 and feed._connect_kwargs["tcp_user_timeout"] == 0
    assert feed._connect_kwargs["keepalives_count"] == 2 and feed._connect_kwargs["keepalives_interval"] == 1


def test_postgres_reconnects_after_the_server_drops_the_connection(pg_empty_url):
    db = connect(pg_empty_url)
    Runner(db).upgrade()
    pid = db.execute_sql("SELECT pg_backend_pid()").fetchone()[0]
    admin = open_database(pg_empty_url)
    admin.execute_sql("SELECT pg_terminate_backend(%s)", (pid,))
    admin.close()
    assert Guild.select().count() == 0          # reopened transparently
    assert db.execute_sql("SELECT pg_backend_pid()").fetchone()[0] != pid
    db.close()
    database.initialize(None)


def test_a_new_sqlite_file_is_private_and_an_existing_one_keeps_its_mode(tmp_path):
    """The database holds secrets' verifiers, token hashes and request history:
    a file the service creates (and its -wal and -shm files) is 0600."""
    import os
    import stat
    url = f"sqlite:///{tmp_path}/new.db"
    db = connect(url)
    Runner(db).upgrade()
    Guild.create(id="1", owner_id="2", plan="free")
    modes = {name: stat.S_IMODE(os.stat(tmp_path / name).st_mode)
             for name in ("new.db", "new.db-wal", "new.db-shm") if (tmp_path / name).exists()}
    db.close()
    database.initialize(None)
    assert "new.db-wal" in modes and modes == {name: 0o600 for name in modes}, modes
    shared = tmp_path / "shared.db"
    shared.touch(mode=0o640)   # made by the operator beforehand: left as it is
    os.chmod(shared, 0o640)
    db = connect(f"sqlite:///{shared}")
    db.execute_sql("CREATE TABLE t (x)")
    db.close()
    database.initialize(None)
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o640


def test_a_file_removed_between_the_check_and_the_open_is_not_made_again(tmp_path):
    # Review, session 28: `create=False` checked that the file existed, then
    # opened it in SQLite's default mode, which makes a missing file: a file
    # removed in between came back empty. The open itself is `mode=rw` now.
    import sqlite3
    path = tmp_path / "gone.db"
    db = open_database(f"sqlite:///{path}", create=False)
    with pytest.raises(sqlite3.OperationalError, match="unable to open database file"):
        db._connect()                     # past the check in connect(), as in the race
    assert not path.exists()


def test_a_connection_to_another_file_put_in_place_is_refused(tmp_path):
    # Review, session 28: a connection opened after a copy was moved over the
    # file opened the copy with the old file's WAL, which corrupted it.
    from models.db import MissingDatabaseFile
    path = tmp_path / "live.db"
    first = open_database(f"sqlite:///{path}")
    first.connect()
    first.execute_sql("CREATE TABLE t (x)")
    first.close()
    (tmp_path / "copy.db").write_bytes(path.read_bytes())
    (tmp_path / "copy.db").replace(path)
    assert first.file_replaced()
    with pytest.raises(MissingDatabaseFile, match="another file was put in place"):
        first.connect()
    # Nor a write through a connection opened before, a setting PRAGMA or a
    # checkpoint included (third review, session 28); reads go on.
    from models.db import _writes
    assert [_writes(sql) for sql in (
        "SELECT 1", "  pragma data_version", "PRAGMA user_version = 7",
        "PRAGMA wal_checkpoint(TRUNCATE)", " /* x */ INSERT INTO t VALUES (1)",
        "WITH a AS (SELECT 1) INSERT INTO t SELECT * FROM a", "REPLACE INTO t VALUES (1)",
        "RELEASE s1", "BEGIN IMMEDIATE")] == [
        False, False, True, True, True, True, True, True, False]
    # Another process of the same service, told the identity, refuses it too.
    other = open_database(f"sqlite:///{path}", create=False, identity=first.identity)
    with pytest.raises(MissingDatabaseFile, match="another file was put in place"):
        other.connect()
