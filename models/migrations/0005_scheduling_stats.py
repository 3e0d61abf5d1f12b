"""0005: per-bucket counts of requests that waited in the sandbox queue and of
those that waited while their guild was deprioritised (over its worker-time
budget).  Requests refused busy are the 503 rows already counted."""
from __future__ import annotations

from peewee import Database, IntegerField
from playhouse.migrate import SchemaMigrator, migrate  # type: ignore[import-untyped]

TABLE = "stat_bucket"
COLUMNS = ("queued", "deprioritised")


def up(db: Database) -> None:
    migrator = SchemaMigrator.from_database(db)
    with db.atomic():
        migrate(*[migrator.add_column(TABLE, name, IntegerField(default=0)) for name in COLUMNS])


def down(db: Database) -> None:
    migrator = SchemaMigrator.from_database(db)
    with db.atomic():
        migrate(*[migrator.drop_column(TABLE, name) for name in COLUMNS])
