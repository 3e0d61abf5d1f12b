"""Guilds (a chat-platform server, keyed by its platform ID) and their managers."""
from __future__ import annotations

from peewee import AutoField, CharField, DateTimeField, ForeignKeyField

from models.clock import utcnow
from models.db import BaseModel


class Guild(BaseModel):
    """A guild: platform ID as primary key (never changes), owner and plan."""

    id = CharField(primary_key=True, max_length=25)
    owner_id = CharField(max_length=64)
    plan = CharField(max_length=32)
    created_at = DateTimeField(default=utcnow)


class GuildManager(BaseModel):
    """A user allowed to edit the guild's scripts and endpoints."""

    id = AutoField()
    guild = ForeignKeyField(Guild, backref="managers", on_delete="CASCADE", index=False)
    user_id = CharField(max_length=64)
    created_at = DateTimeField(default=utcnow)

    class Meta:
        indexes = ((("guild", "user_id"), True),)
