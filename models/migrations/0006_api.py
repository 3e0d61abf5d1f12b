"""0006: the admin API — token expiry, test calls marked in history and statistics.

- `api_token.expires_at` (NULL: never expires);
- `request_record.test`: the request was a test call or a replay from the API;
- `stat_bucket.test_count`: how many of a bucket's `count` were test calls.
"""
from __future__ import annotations

from peewee import BooleanField, Database, DateTimeField, IntegerField
from playhouse.migrate import SchemaMigrator, migrate  # type: ignore[import-untyped]


def up(db: Database) -> None:
    m = SchemaMigrator.from_database(db)
    migrate(
        m.add_column("api_token", "expires_at", DateTimeField(null=True)),
        m.add_column("request_record", "test", BooleanField(default=False)),
        m.add_column("stat_bucket", "test_count", IntegerField(default=0)),
    )


def down(db: Database) -> None:
    m = SchemaMigrator.from_database(db)
    migrate(
        m.drop_column("stat_bucket", "test_count"),
        m.drop_column("request_record", "test"),
        m.drop_column("api_token", "expires_at"),
    )
