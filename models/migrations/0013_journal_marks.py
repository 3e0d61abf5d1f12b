"""0013: how far each records journal run is in the database (replay writes
nothing twice).  Additive: nodes of the release before do not use it.  Frozen copy."""
from __future__ import annotations

from peewee import BigIntegerField, CharField, Database, DateTimeField, Model


class JournalMark(Model):
    run = CharField(max_length=16, primary_key=True)
    segment = BigIntegerField()
    position = BigIntegerField()
    updated = DateTimeField(index=True)

    class Meta:
        table_name = "journal_mark"


NEW = [JournalMark]


def up(db: Database) -> None:
    with db.bind_ctx(NEW):
        db.create_tables(NEW, safe=False)


def down(db: Database) -> None:
    with db.bind_ctx(NEW):
        db.drop_tables(list(reversed(NEW)), safe=False)
