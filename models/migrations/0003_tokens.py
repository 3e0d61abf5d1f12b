"""0003: admin API tokens and one-time login links (hashed).  Frozen copies."""
from __future__ import annotations

from peewee import AutoField, CharField, Database, DateTimeField, Model


class ApiToken(Model):
    id = AutoField()
    token_hash = CharField(max_length=64, unique=True)
    hint = CharField(max_length=4)
    kind = CharField(max_length=16)
    user_id = CharField(max_length=64, null=True)
    created_at = DateTimeField()
    last_used_at = DateTimeField(null=True)
    revoked_at = DateTimeField(null=True)

    class Meta:
        table_name = "api_token"


class LoginToken(Model):
    id = AutoField()
    token_hash = CharField(max_length=64, unique=True)
    user_id = CharField(max_length=64)
    created_at = DateTimeField()
    expires_at = DateTimeField()
    used_at = DateTimeField(null=True)

    class Meta:
        table_name = "login_token"


NEW = [ApiToken, LoginToken]


def up(db: Database) -> None:
    with db.bind_ctx(NEW):
        db.create_tables(NEW, safe=False)


def down(db: Database) -> None:
    with db.bind_ctx(NEW):
        db.drop_tables(list(reversed(NEW)), safe=False)
