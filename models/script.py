"""Scripts and their one endpoint each.

A script's public ID (`logicScriptId`) is not reused: deleting a script
keeps its row as a tombstone (`deleted_at` set, source cleared), and the unique
index on `public_id` refuses the same ID while it is kept (a guild's newest
1,000 tombstones; `service.core.scripts.KEPT_TOMBSTONES`).
"""
from __future__ import annotations

from peewee import (SQL, AutoField, BigAutoField, BooleanField, CharField, DateTimeField,
                    ForeignKeyField, IntegerField, TextField)

from models.clock import utcnow
from models.db import BaseModel
from models.guild import Guild


class Script(BaseModel):
    """A guild's script; `version` grows on every source update."""

    id = AutoField()
    public_id = CharField(max_length=28, unique=True)
    guild = ForeignKeyField(Guild, backref="scripts", on_delete="CASCADE", index=False)
    name = CharField(max_length=100)
    source = TextField()
    version = IntegerField(default=1)
    created_at = DateTimeField(default=utcnow)
    updated_at = DateTimeField(default=utcnow)
    deleted_at = DateTimeField(null=True)
    warnings = TextField(null=True)        # JSON list: save-time warnings of `source`

    class Meta:
        # Listing a guild's live scripts, and the guild part of the hot lookup.
        indexes = ((("guild", "deleted_at"), False),)


class ScriptVersion(BaseModel):
    """One kept version of a script's source (the newest per script, by count and bytes)."""

    id = BigAutoField()
    script = ForeignKeyField(Script, backref="versions", on_delete="CASCADE", index=False)
    version = IntegerField()
    source = TextField()
    # len(source) in UTF-8; the database's own default lets nodes of the release
    # before 0011 keep saving versions during a rolling upgrade.
    source_bytes = IntegerField(default=0, constraints=[SQL("DEFAULT 0")])
    author = CharField(max_length=80)          # actor label: "operator" or "user:<id>"
    created_at = DateTimeField(default=utcnow)

    class Meta:
        indexes = ((("script", "version"), True),)


class Endpoint(BaseModel):
    """The inbound HTTP endpoint of one script: switch, secret hash, whitelist."""

    id = AutoField()
    script = ForeignKeyField(Script, backref="endpoint_rows", on_delete="CASCADE", unique=True)
    enabled = BooleanField(default=False)
    enabled_at = DateTimeField(null=True)
    secret_hash = CharField(max_length=255, null=True)
    secret_hint = CharField(max_length=4, null=True)
    secret_created_at = DateTimeField(null=True)
    secret_created_by = CharField(max_length=64, null=True)
    whitelist = TextField(default="[]")      # JSON list of normalised CIDRs
    created_at = DateTimeField(default=utcnow)
