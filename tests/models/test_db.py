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


def test_postgres_url_parts():
    db = open_database("postgresql://u:p%40ss@h:5433/name?sslmode=require&connect_timeout=3")
    assert isinstance(db, PostgresqlDatabase) and db.database == "name"
    assert db.connect_params == {"user": "u", "password": "p@ss", "host": "h", "port": 5433,
                                 "sslmode": "require", "connect_timeout": 3}


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
