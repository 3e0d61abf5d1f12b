"""`written`: wait until what a request queued for the records writer is in the database.

A test call (admin API, dashboard) answers with the id of the request it
recorded, and the caller's next step is often to read or replay that request
(docs/admin-api.md), possibly through another front process. The writer
writes in order, so a `WriteBarrier` queued after the test call's records is
released once everything before it was written (or given up on: held while
the database is unreachable, or the writer stopped); the writer is woken for
it instead of waiting for its next turn.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.http.records import RecordWriter

#: How long a test call waits for its records at most (a database that is
#: slow but up); while it is unreachable, not at all.
WAIT_S = 2.0


class WriteBarrier:
    """A queue entry that is not a record: released by the writer's thread."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.future: asyncio.Future[bool] = self._loop.create_future()

    def release(self, ok: bool) -> None:
        """From any thread: the entries queued before this one are done with,
        written (`ok`) or not (held while the database is unreachable, or the
        writer stopped)."""
        def done() -> None:
            if not self.future.done():
                self.future.set_result(ok)
        try:
            self._loop.call_soon_threadsafe(done)
        except RuntimeError:   # the loop is closed: nobody waits any more
            pass


async def written(writer: RecordWriter, timeout: float = WAIT_S) -> bool:
    """Wait until every entry queued so far is written; False when it took longer
    than `timeout` or the database is unreachable (the records stay queued)."""
    if writer.database_down or not writer.running:
        return False
    barrier = WriteBarrier()
    writer.put_barrier(barrier)
    try:
        return await asyncio.wait_for(asyncio.shield(barrier.future), timeout)
    except asyncio.TimeoutError:
        return False
