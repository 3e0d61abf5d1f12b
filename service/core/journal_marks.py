"""Journal marks: how far each records journal run is in the database.

The record writer stores a batch's mark — (run, segment, position) of its
last journaled entry — in the batch's own transaction (`set_mark`, called by
`records.write_batch`); replay after a crash skips every entry at or before
its run's mark (`marks`), so a crash between two batches of one writer turn,
or between a commit and the emptying of its segments, writes nothing twice.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Iterable

from models import JournalMark, database
from models.clock import utcnow

#: (run, segment number, byte position just past the entry).
Mark = tuple[str, int, int]
#: A run's mark older than this is deleted (a journal left unreplayed that long
#: is replayed without it: at worst a batch twice, as before marks existed).
KEEP_DAYS = 30


def set_mark(mark: Mark) -> None:
    """Record `mark` (call inside the transaction that wrote what it covers)."""
    run, segment, position = mark
    db = database.obj
    sql = _UPSERT.get(type(db))
    if sql is None:   # built once per kind of database (peewee builds it in ~0.1 ms)
        sql = _UPSERT[type(db)] = (
            JournalMark.insert(run="", segment=0, position=0, updated=utcnow())
            .on_conflict(conflict_target=[JournalMark.run],
                         preserve=[JournalMark.segment, JournalMark.position,
                                   JournalMark.updated])
            .sql()[0])
    updated = JournalMark.updated.db_value(utcnow())  # type: ignore[no-untyped-call]
    db.execute_sql(sql, (run, segment, position, updated))


_UPSERT: dict[type, str] = {}


def marks(runs: Iterable[str]) -> dict[str, tuple[int, int]]:
    """The stored (segment, position) of each of `runs` that has one."""
    wanted = sorted(set(runs))
    if not wanted:
        return {}
    return {m.run: (m.segment, m.position)
            for m in JournalMark.select().where(JournalMark.run.in_(wanted))}


def forget(runs: Iterable[str]) -> None:
    """Delete the marks of `runs` (their segments are gone), and every mark
    not updated for `KEEP_DAYS`."""
    wanted = sorted(set(runs))
    if wanted:
        JournalMark.delete().where(JournalMark.run.in_(wanted)).execute()
    JournalMark.delete().where(JournalMark.updated < utcnow() - timedelta(days=KEEP_DAYS)).execute()
