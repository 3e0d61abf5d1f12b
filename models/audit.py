"""Audit records: who did what.  No foreign keys, so the trail outlives what
it talks about; never holds a secret (callers pass only IDs and settings)."""
from __future__ import annotations

from peewee import BigAutoField, CharField, DateTimeField, TextField

from models.clock import utcnow
from models.db import BaseModel


class AuditRecord(BaseModel):
    id = BigAutoField()
    time = DateTimeField(default=utcnow)
    actor = CharField(max_length=80)            # "operator" or "user:<id>"
    guild_id = CharField(max_length=25, null=True)
    script_id = CharField(max_length=28, null=True)
    action = CharField(max_length=40)
    detail = TextField(default="{}")            # JSON

    class Meta:
        indexes = ((("guild_id", "id"), False),)
