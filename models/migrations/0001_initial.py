"""0001: guilds, managers, scripts, endpoints, request/error records, audit.

Frozen copies of the models as they were at this version: never import the
live models here, or old migrations would change under an older database.
"""
from __future__ import annotations

from peewee import (AutoField, BigAutoField, BooleanField, CharField, Database,
                    DateTimeField, FloatField, ForeignKeyField, IntegerField, Model,
                    SmallIntegerField, TextField)


class Guild(Model):
    id = CharField(primary_key=True, max_length=25)
    owner_id = CharField(max_length=64)
    plan = CharField(max_length=32)
    created_at = DateTimeField()

    class Meta:
        table_name = "guild"


class GuildManager(Model):
    guild = ForeignKeyField(Guild, on_delete="CASCADE", index=False)
    user_id = CharField(max_length=64)
    created_at = DateTimeField()

    class Meta:
        table_name = "guild_manager"
        indexes = ((("guild", "user_id"), True),)


class Script(Model):
    id = AutoField()
    public_id = CharField(max_length=28, unique=True)
    guild = ForeignKeyField(Guild, on_delete="CASCADE", index=False)
    name = CharField(max_length=100)
    source = TextField()
    version = IntegerField(default=1)
    created_at = DateTimeField()
    updated_at = DateTimeField()
    deleted_at = DateTimeField(null=True)

    class Meta:
        table_name = "script"
        indexes = ((("guild", "deleted_at"), False),)


class Endpoint(Model):
    id = AutoField()
    script = ForeignKeyField(Script, on_delete="CASCADE", unique=True)
    enabled = BooleanField(default=False)
    enabled_at = DateTimeField(null=True)
    secret_hash = CharField(max_length=255, null=True)
    secret_hint = CharField(max_length=4, null=True)
    secret_created_at = DateTimeField(null=True)
    secret_created_by = CharField(max_length=64, null=True)
    whitelist = TextField(default="[]")
    created_at = DateTimeField()

    class Meta:
        table_name = "endpoint"


class RequestRecord(Model):
    id = BigAutoField()
    endpoint = ForeignKeyField(Endpoint, on_delete="CASCADE", index=False)
    request_id = CharField(max_length=64)
    time = DateTimeField()
    method = CharField(max_length=16)
    query = TextField(default="{}")
    headers = TextField(default="{}")
    body = TextField(default="")
    body_encoding = CharField(max_length=8, default="text")
    body_truncated = BooleanField(default=False)
    ip = CharField(max_length=45)
    user_agent = TextField(default="")
    status = SmallIntegerField()
    response_headers = TextField(default="{}")
    response_body = TextField(default="")
    response_body_encoding = CharField(max_length=8, default="text")
    response_body_truncated = BooleanField(default=False)
    duration_ms = FloatField()
    output = TextField(default="")
    error = TextField(null=True)

    class Meta:
        table_name = "request_record"
        indexes = ((("endpoint", "id"), False),)


class ErrorRecord(Model):
    id = BigAutoField()
    endpoint = ForeignKeyField(Endpoint, on_delete="CASCADE", index=False)
    request_id = CharField(max_length=64)
    time = DateTimeField()
    kind = CharField(max_length=32)
    message = TextField()
    line = IntegerField(null=True)
    traceback = TextField(null=True)

    class Meta:
        table_name = "error_record"
        indexes = ((("endpoint", "id"), False),)


class AuditRecord(Model):
    id = BigAutoField()
    time = DateTimeField()
    actor = CharField(max_length=80)
    guild_id = CharField(max_length=25, null=True)
    script_id = CharField(max_length=28, null=True)
    action = CharField(max_length=40)
    detail = TextField(default="{}")

    class Meta:
        table_name = "audit_record"
        indexes = ((("guild_id", "id"), False),)


MODELS = [Guild, GuildManager, Script, Endpoint, RequestRecord, ErrorRecord, AuditRecord]


def up(db: Database) -> None:
    with db.bind_ctx(MODELS):
        db.create_tables(MODELS, safe=False)


def down(db: Database) -> None:
    with db.bind_ctx(MODELS):
        db.drop_tables(list(reversed(MODELS)), safe=False)
