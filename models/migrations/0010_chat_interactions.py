"""0010: ids of accepted chat interactions (replays refused on every node).  Frozen copy."""
from __future__ import annotations

from peewee import CharField, Database, DateTimeField, Model


class SeenInteraction(Model):
    id = CharField(max_length=25, primary_key=True)
    seen_at = DateTimeField(index=True)

    class Meta:
        table_name = "chat_interaction"


NEW = [SeenInteraction]


def up(db: Database) -> None:
    with db.bind_ctx(NEW):
        db.create_tables(NEW, safe=False)


def down(db: Database) -> None:
    with db.bind_ctx(NEW):
        db.drop_tables(list(reversed(NEW)), safe=False)
