"""0012: SQLite counts the commits that change what an endpoint lookup reads.

The invoke path keeps endpoint lookups in memory (`service.core.invoke_target`)
and, on SQLite, sees from the WAL index header that *something* committed;
most commits are the records writer's (history, statistics), which never
touch a guild, script or endpoint. A one-row table `target_generation` and
a trigger per table and statement kind add one to its `n` in the same
transaction as every insert, update or delete of a `guild`, `script` or
`endpoint` row, from any connection of any process (the `logic` CLI
included): the lookups' cache keeps its answers while `n` stays the same.

The cache trusts `n` only while all nine triggers exist as made here (name,
table and statement, `TRIGGER_DEFINITIONS`, checked in the same statement
that reads `n`), and takes any schema change for a change
(`service.core.target_generation`): a later migration that rebuilds one of
these tables must create its triggers again with these very statements, or
the cache drops its answers on every commit, as before this one. PostgreSQL needs nothing: its
change feed (0004, 0009) already notifies exactly these changes.
"""
from __future__ import annotations

from peewee import Database, PostgresqlDatabase

TABLE = "target_generation"
TABLES = ("guild", "script", "endpoint")
OPERATIONS = ("insert", "update", "delete")
TRIGGERS = tuple(f"logic_generation_{table}_{op}" for table in TABLES for op in OPERATIONS)


def trigger_sql(table: str, op: str) -> str:
    """The statement that makes the trigger of `table` for `op`: SQLite keeps it
    verbatim in `sqlite_master.sql`, where the cache checks it is still this one."""
    return (f'CREATE TRIGGER logic_generation_{table}_{op} AFTER {op.upper()} ON "{table}" '
            f"BEGIN UPDATE {TABLE} SET n = n + 1 WHERE id = 1; END")


#: (name, table, statement) of each trigger, in the order of `TRIGGERS`.
TRIGGER_DEFINITIONS = tuple((f"logic_generation_{table}_{op}", table, trigger_sql(table, op))
                            for table in TABLES for op in OPERATIONS)


def up(db: Database) -> None:
    if isinstance(db, PostgresqlDatabase):
        return
    with db.atomic():
        db.execute_sql(  # type: ignore[no-untyped-call]
            f"CREATE TABLE {TABLE} (id INTEGER PRIMARY KEY CHECK (id = 1), n INTEGER NOT NULL)")
        db.execute_sql(f"INSERT INTO {TABLE} (id, n) VALUES (1, 0)")  # type: ignore[no-untyped-call]
        for _, _, statement in TRIGGER_DEFINITIONS:
            db.execute_sql(statement)  # type: ignore[no-untyped-call]


def down(db: Database) -> None:
    if isinstance(db, PostgresqlDatabase):
        return
    with db.atomic():
        for name in TRIGGERS:
            db.execute_sql(f"DROP TRIGGER IF EXISTS {name}")  # type: ignore[no-untyped-call]
        db.execute_sql(f"DROP TABLE IF EXISTS {TABLE}")  # type: ignore[no-untyped-call]
