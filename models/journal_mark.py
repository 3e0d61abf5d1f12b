"""How far each run of a records journal is in the database.

A records journal (`service.http.journal`) names its segment files after its
run (a random id per opening). The record writer stores, in the transaction
of each batch, the position of the batch's last journaled entry: replay after
a crash skips every entry at or before it, so nothing is written twice, however
many batches of a turn were committed before the crash.
"""
from __future__ import annotations

from peewee import BigIntegerField, CharField, DateTimeField

from models.clock import utcnow
from models.db import BaseModel


class JournalMark(BaseModel):
    """The last journaled entry of one journal run that is in the database."""

    run = CharField(max_length=16, primary_key=True)
    segment = BigIntegerField()    # the segment's number
    position = BigIntegerField()   # the byte just past the entry in that segment
    updated = DateTimeField(default=utcnow, index=True)

    class Meta:
        table_name = "journal_mark"
