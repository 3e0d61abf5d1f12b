"""Database fixtures shared by model and service-layer tests.

`db` is parametrised over SQLite and PostgreSQL:
- SQLite: a fresh file per test, migrated to the latest schema;
- PostgreSQL (`TEST_DATABASE_URL`, default the local server): one schema per
  test session and xdist worker, selected through `search_path` and dropped
  at the end; tables are emptied before each test.  Skipped, saying why, only
  when the server cannot be reached.
"""
from __future__ import annotations

import os
import uuid
from typing import Iterator
from urllib.parse import quote

import pytest
from peewee import Database

from models.db import connect, database
from models.migrate import HISTORY_TABLE, Runner

DEFAULT_PG_URL = "postgresql://postgres@127.0.0.1:5432/test"


def pg_base_url() -> str:
    return os.environ.get("TEST_DATABASE_URL", DEFAULT_PG_URL)


def pg_unreachable_reason() -> str | None:
    """None when PostgreSQL answers, else why not.  A missing driver is not a
    reason to skip: it fails (install the `test` extra)."""
    import psycopg2
    from models.db import open_database
    db = open_database(pg_base_url())
    try:
        conn = psycopg2.connect(dbname=db.database, **{**db.connect_params, "connect_timeout": 3})
    except psycopg2.OperationalError as err:
        return f"PostgreSQL at {pg_base_url()} is not reachable: {str(err).strip().splitlines()[0]}"
    conn.close()
    return None


def with_search_path(url: str, schema: str) -> str:
    """`url` with `options=-c search_path=<schema>` added."""
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}options={quote(f'-c search_path={schema}')}"


class PgSchema:
    """A throw-away schema on the test server."""

    def __init__(self) -> None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.name = f"t_{worker}_{uuid.uuid4().hex[:10]}"
        self.url = with_search_path(pg_base_url(), self.name)
        self._admin = connect_admin()
        self._admin.execute_sql(f'CREATE SCHEMA "{self.name}"')

    def drop(self) -> None:
        self._admin.execute_sql(f'DROP SCHEMA IF EXISTS "{self.name}" CASCADE')
        self._admin.close()


def connect_admin() -> Database:
    from models.db import open_database
    db = open_database(pg_base_url())
    db.connect()
    return db


def truncate_all(db: Database) -> None:
    tables = [t for t in db.get_tables() if t != HISTORY_TABLE]
    if tables:
        db.execute_sql("TRUNCATE " + ", ".join(f'"{t}"' for t in tables) + " RESTART IDENTITY CASCADE")


@pytest.fixture(scope="session")
def pg_schema() -> Iterator[PgSchema]:
    reason = pg_unreachable_reason()
    if reason:
        pytest.skip(reason)
    schema = PgSchema()
    yield schema
    schema.drop()


@pytest.fixture(scope="session")
def pg_migrated(pg_schema: PgSchema) -> Iterator[str]:
    db = connect(pg_schema.url)
    Runner(db).upgrade()
    db.close()
    yield pg_schema.url


@pytest.fixture
def pg_empty_url(pg_schema: PgSchema) -> Iterator[str]:
    """A URL to a fresh, empty PostgreSQL schema (for migration and CLI tests)."""
    name = f"{pg_schema.name}_{uuid.uuid4().hex[:6]}"
    admin = connect_admin()
    admin.execute_sql(f'CREATE SCHEMA "{name}"')
    yield with_search_path(pg_base_url(), name)
    admin.execute_sql(f'DROP SCHEMA "{name}" CASCADE')
    admin.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: "os.PathLike[str]") -> str:
    """An empty, un-migrated database URL on each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/test.db"
    return str(request.getfixturevalue("pg_empty_url"))


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: "os.PathLike[str]") -> Iterator[Database]:
    """A migrated, empty database bound to the model proxy."""
    from service.core.records import reset_sweeps
    reset_sweeps()          # endpoint ids restart in every fresh database
    if request.param == "sqlite":
        handle = connect(f"sqlite:///{tmp_path}/test.db")
        Runner(handle).upgrade()
    else:
        handle = connect(request.getfixturevalue("pg_migrated"))
        truncate_all(handle)
    yield handle
    handle.close()
    database.initialize(None)
