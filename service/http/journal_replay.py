"""Replaying the records journal at start-up: what a process that did not stop
cleanly answered but had not written (`service.http.journal`).

All of a start's replay is one transaction; the writer's marks (one per run)
say what reached the database before the crash, so nothing is written twice;
an entry no column takes is dropped alone; a segment whose replay stopped at
an unreadable entry is set aside (`damaged-...`), not deleted.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from service.http.journal import Journal, read_segments, run_of
from service.http.record_batches import expand

log = logging.getLogger("logic.server")


def replay_journal(journal: Journal, batch: int = 5000) -> None:
    """Write the records journaled by a process that did not stop cleanly.

    All in one transaction, so a start that fails meanwhile (the database
    unreachable) has written nothing that the next start writes again. An
    entry that cannot be stored (a damaged file: values the service never
    journals) is dropped alone, in a savepoint of its own, and counted: it
    must not keep the service from starting, nor cost the others.
    """
    from peewee import InterfaceError, OperationalError

    from models.db import database
    from service.core import journal_marks
    from service.core.records import write_batch

    leftovers = journal.leftovers()
    if not leftovers:
        return

    def stored(part: list[Any]) -> bool:
        """Whether `part` was written (in a savepoint: nothing of it when not)."""
        try:
            with database.atomic():
                write_batch(expand(part))
        except (OperationalError, InterfaceError):
            raise                       # the database: the start fails, nothing written
        except Exception:  # noqa: BLE001 - a value no column takes
            return False
        return True

    damaged: list[tuple[Path, int]] = []
    entries = list(read_segments(leftovers, damaged))
    # What the writer had in the database before the crash (a mark per run).
    done = journal_marks.marks(e.mark[0] for e in entries if e.mark is not None)
    entries = [e for e in entries if not _written(e.mark, done)]
    reached: dict[str, journal_marks.Mark] = {}
    dropped = 0
    with database.atomic():
        for start in range(0, len(entries), batch):
            part = entries[start:start + batch]
            if not stored(part):        # one by one: only what fails alone is dropped
                dropped += sum(not stored([entry]) for entry in part)
        for entry in entries:
            if entry.mark is not None:
                reached[entry.mark[0]] = entry.mark   # segments are read in order
        for mark in reached.values():   # a crash before `discard` replays nothing twice
            journal_marks.set_mark(mark)
    kept = _keep_damaged(damaged)
    journal.discard([p for p in leftovers if p not in kept])
    # A mark goes with the last segment of its run (kept while any is left).
    left = {run_of(p) for p in journal.leftovers()}
    named = {run_of(p) for p in leftovers}   # a run's files, entries in them or not
    journal_marks.forget(run for run in named if run is not None and run not in left)
    log.info("replayed %d journaled requests from %d segments", len(entries) - dropped,
             len(leftovers))
    if dropped:
        log.warning("journal: %d entries could not be stored and were dropped (a damaged "
                    "file?)", dropped)


def _keep_damaged(damaged: list[tuple[Path, int]]) -> set[Path]:
    """Set aside segments whose replay stopped at an unreadable entry (what
    came before it is written): renamed `damaged-...`, never replayed or
    deleted by the service, for the operator to look into. Returns those kept."""
    kept: set[Path] = set()
    for path, offset in damaged:
        aside = path.with_name(f"damaged-{path.name}")
        try:
            os.replace(path, aside)
        except OSError as err:
            log.error("journal %s: unreadable from byte %d, and it could not be set aside "
                      "(%s): deleted", path.name, offset, err.strerror)
            continue
        kept.add(path)
        log.error("journal %s: unreadable from byte %d (damaged: the entries before it were "
                  "written, the rest is lost); the file is kept as %s, delete it once looked "
                  "into", path.name, offset, aside)
    return kept


def _written(mark: tuple[str, int, int] | None, done: dict[str, tuple[int, int]]) -> bool:
    """Whether the entry at `mark` was in the database before its process died."""
    if mark is None or mark[0] not in done:
        return False
    return (mark[1], mark[2]) <= done[mark[0]]
