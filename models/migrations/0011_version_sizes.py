"""0011: each kept version's source size in UTF-8 bytes, so the versions of a
script are pruned to a byte budget and listed without reading their sources.
Rows already there get their size from their source.  Additive: the column
has a database default (0), so nodes of the release before, which do not
know it, keep saving versions until restarted."""
from __future__ import annotations

from peewee import SQL, Database, IntegerField, PostgresqlDatabase
from playhouse.migrate import SchemaMigrator, migrate  # type: ignore[import-untyped]

TABLE = "script_version"
COLUMN = "source_bytes"


def up(db: Database) -> None:
    migrator = SchemaMigrator.from_database(db)
    size = ("octet_length(source)" if isinstance(db, PostgresqlDatabase)
            else "length(CAST(source AS BLOB))")
    with db.atomic():
        migrate(migrator.add_column(TABLE, COLUMN,
                                    IntegerField(default=0, constraints=[SQL("DEFAULT 0")])))
        db.execute_sql(f"UPDATE {TABLE} SET {COLUMN} = {size}")  # type: ignore[no-untyped-call]


def down(db: Database) -> None:
    migrator = SchemaMigrator.from_database(db)
    with db.atomic():
        migrate(migrator.drop_column(TABLE, COLUMN))
