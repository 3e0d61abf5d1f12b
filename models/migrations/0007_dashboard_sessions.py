"""0007: dashboard sessions (hash of the cookie token, timeouts, end).  Frozen copy."""
from __future__ import annotations

from peewee import AutoField, CharField, Database, DateTimeField, Model


class DashboardSession(Model):
    id = AutoField()
    token_hash = CharField(max_length=64, unique=True)
    user_id = CharField(max_length=64, index=True)
    created_at = DateTimeField()
    last_seen_at = DateTimeField()
    expires_at = DateTimeField()
    ended_at = DateTimeField(null=True)
    end_reason = CharField(max_length=16, null=True)

    class Meta:
        table_name = "dashboard_session"


NEW = [DashboardSession]


def up(db: Database) -> None:
    with db.bind_ctx(NEW):
        db.create_tables(NEW, safe=False)


def down(db: Database) -> None:
    with db.bind_ctx(NEW):
        db.drop_tables(list(reversed(NEW)), safe=False)
