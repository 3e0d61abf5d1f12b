"""0004: PostgreSQL notifies `logic_targets` when a guild, script or endpoint changes.

The invoke path keeps endpoint lookups in memory (`service.core.invoke_target`)
and drops them when this notification arrives (`models.change_feed`); one
statement-level trigger per table sends it in the writer's transaction, so it
is delivered exactly when the change commits, whichever node or tool made it.
SQLite needs nothing: its `PRAGMA data_version` already counts commits.
"""
from __future__ import annotations

from peewee import Database, PostgresqlDatabase

CHANNEL = "logic_targets"
TABLES = ("guild", "script", "endpoint")

_FUNCTION = f"""
CREATE OR REPLACE FUNCTION logic_notify_targets() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('{CHANNEL}', TG_TABLE_NAME);
    RETURN NULL;
END
$$ LANGUAGE plpgsql
"""


def up(db: Database) -> None:
    if not isinstance(db, PostgresqlDatabase):
        return
    db.execute_sql(_FUNCTION)  # type: ignore[no-untyped-call]
    for table in TABLES:
        db.execute_sql(  # type: ignore[no-untyped-call]
            f"CREATE TRIGGER logic_notify_{table} AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE "
            f'ON "{table}" FOR EACH STATEMENT EXECUTE FUNCTION logic_notify_targets()')


def down(db: Database) -> None:
    if not isinstance(db, PostgresqlDatabase):
        return
    for table in TABLES:
        db.execute_sql(f'DROP TRIGGER IF EXISTS logic_notify_{table} ON "{table}"')  # type: ignore[no-untyped-call]
    db.execute_sql("DROP FUNCTION IF EXISTS logic_notify_targets()")  # type: ignore[no-untyped-call]
