"""The records writer's view of the database: up, or down since when, and its bounds.

`RecordWriter` (service.http.records) holds a batch whose write failed with a
connection error and retries it (`retry_s`: `RETRY_S`, doubling up to
`RETRY_MAX_S`); `Outage` says so once when it begins and once when it ends.

On PostgreSQL every statement of the writer's thread is bounded
(`WRITE_TIMEOUT_S`, from the statement's start: `models.db_watch.DeadlineWatch`):
a database, proxy or pooler that keeps the connection open but answers
nothing (or a lock the statement waits on) ends the statement then, like a
lost connection, instead of holding the writer for ever.
"""
from __future__ import annotations

import logging
import time

from models.db_watch import StatementTimedOut
from service.http.record_batches import local_reason

log = logging.getLogger("logic.records")

#: While the database is unreachable: first retry after this, doubling up to RETRY_MAX_S.
RETRY_S = 0.25
RETRY_MAX_S = 2.0
#: A statement of the writer unanswered this long after its start is cancelled
#: (its connection shut if the cancel brings nothing): the database counts as
#: unreachable. A batch's statements are bounded in size (`models.bulk`).
WRITE_TIMEOUT_S = 10.0
#: The writer's session ends a statement itself this long past WRITE_TIMEOUT_S
#: (`statement_timeout`), should the cancel not reach it.
SERVER_MARGIN_S = 3.0


def timed_out(err: BaseException) -> StatementTimedOut | None:
    """The `StatementTimedOut` in `err`'s chain (a rollback's error may come on top)."""
    seen: BaseException | None = err
    for _ in range(8):
        if seen is None:
            break
        if isinstance(seen, StatementTimedOut):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class Outage:
    """Since when writes find the database unreachable, and the retry's wait."""

    def __init__(self, max_queued: int) -> None:
        self._max_queued = max_queued
        self.since: float | None = None
        self.retry_s = RETRY_S
        self.dropped_at = 0   # the writer's `dropped` when it began
        self._words = ("the database is unreachable", "the database is reachable")

    @property
    def down(self) -> bool:
        return self.since is not None

    def began(self, err: BaseException, size: int, dropped: int) -> None:
        """A write found the database unreachable (said once per outage)."""
        self.retry_s = min(RETRY_MAX_S, self.retry_s * 2) if self.since else RETRY_S
        if self.since is not None:
            return
        self.since = time.monotonic()
        self.dropped_at = dropped
        local = local_reason(err)
        self._words = (("writing records to the database fails", "writing records works")
                       if local else ("the database is unreachable", "the database is reachable"))
        # A server's error: its kind only (its text may carry the server's
        # address); a SQLite file's reason is the operator's to know, and a
        # statement given up on says after how long.
        stalled = timed_out(err)
        log.warning("%s (%s): records wait in memory (%d now, at most %d) and are written "
                    "when it is back", self._words[0],
                    local or (str(stalled) if stalled else type(err).__name__),
                    size, self._max_queued)

    def ended(self, dropped: int) -> None:
        """A write succeeded after an outage."""
        assert self.since is not None
        lost = dropped - self.dropped_at
        log.warning("%s again after %.1f s: waiting records written%s", self._words[1],
                    time.monotonic() - self.since,
                    f"; {lost} dropped while the buffer was full" if lost else "")
        self.since = None
