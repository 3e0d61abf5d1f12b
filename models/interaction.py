"""Chat interactions already answered: their ids, kept while a replay could still pass.

A signed interaction is accepted once: its id is inserted here before the
command runs, and a second insert of the same id (a replay, from any front
process or node sharing the database, or after a restart) fails on the
primary key.  Rows older than twice the signature window are deleted: by
then the signature's own timestamp refuses the replay.
"""
from __future__ import annotations

from peewee import CharField, DateTimeField

from models.clock import utcnow
from models.db import BaseModel


class SeenInteraction(BaseModel):
    """One accepted chat interaction id (the platform's snowflake)."""

    id = CharField(max_length=25, primary_key=True)
    seen_at = DateTimeField(default=utcnow, index=True)

    class Meta:
        table_name = "chat_interaction"
