"""The batched history / error-log / statistics writer of the invoke path.

Handlers hand finished requests to `RecordWriter.put()`, which only appends to
a deque: no database work, no lock and no thread wake-up on the event loop.
One background thread wakes every `interval` seconds (sooner when `max_batch`
entries are waiting), takes everything queued and writes it in one transaction
through the service layer. A batch costs a statistics row per endpoint (four,
with the minute and hour buckets, the latency sketch and the caller's
address), so when one spans more than `spread_endpoints` endpoints (requests
spread over many scripts: each is in a batch only once or twice) the writer
waits `spread_interval` for the next one, where the same endpoints' requests
add up to the same rows; a batch over fewer endpoints brings the short wait
back (docs/performance.md: with 1,000 endpoints in rotation the writer's CPU
per request halves). `stop()` writes everything still queued, so a
SIGTERM loses no record; with a `Journal` (as `logic serve` runs it) a crash
of the process loses none either (service.http.journal). What a stop leaves
unwritten (the database unreachable, or the writer still in a statement when
the stop's wait ends) is counted: `dropped`, or `kept` by the journal.

While the database is unreachable (a write fails with a connection error, or
a statement gets no answer within `WRITE_TIMEOUT_S` on PostgreSQL:
service.http.record_outage), entries stay queued, in order, and the writer
retries (0.25 s, doubling to 2 s); they are written once it answers, each
exactly once. The bound
(`max_queued`) counts every entry not yet written: queued, in the batch being
written, or held by a batch that found the database down; past it, new
entries are dropped and counted, with one warning per episode. Other write
errors are retried twice, then that batch is dropped and counted.

Entries are converted to records in the writer thread, and only as far as
they can be kept: a plan keeps the newest N requests of an endpoint, so of a
batch only each endpoint's newest N become history rows; every entry still
counts in the statistics. Under load this is most of the saving: at 4,000
requests/s and N = 200, four in five entries of a 0.25 s batch are never
converted (docs/performance.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from peewee import InterfaceError, OperationalError

from service.http.journal import Journal
from service.http.journal_facts import JournaledRequest
from service.http.record_batches import expand, mark_of
from service.http.record_outage import RETRY_MAX_S, RETRY_S, WRITE_TIMEOUT_S, Outage
from service.http.write_barrier import WriteBarrier

log = logging.getLogger("logic.records")

__all__ = ["RecordWriter", "Recordable", "RETRY_S", "RETRY_MAX_S", "WRITE_TIMEOUT_S"]
#: A batch over more endpoints than this makes the writer wait SPREAD_INTERVAL_S next.
SPREAD_ENDPOINTS = 256
SPREAD_INTERVAL_S = 1.0


class Recordable(Protocol):
    """A finished request that knows its records (see `service.http.invoke.InvokeRequest`)."""

    def history_slot(self) -> tuple[int, int] | None:
        """(endpoint id, history size of its plan) if it goes to history, else None."""

    def records(self, history: bool) -> list[Any]:
        """Its record items; the history record only if `history`."""


class RecordWriter:
    """A single background thread that writes queued records in batches."""

    def __init__(
        self,
        write_batch: Callable[..., None],
        *,
        interval: float = 0.25,
        spread_interval: float = SPREAD_INTERVAL_S,
        spread_endpoints: int = SPREAD_ENDPOINTS,
        max_batch: int = 20_000,
        max_queued: int = 200_000,
        on_thread_start: Callable[[], object] | None = None,
        on_thread_stop: Callable[[], object] | None = None,
        journal: Journal | None = None,
        forget_run: Callable[[str], object] | None = None,
    ) -> None:
        self._journal = journal
        self._forget_run = forget_run
        self._journal_errors = 0
        self._write_batch = write_batch
        self._interval = interval
        self._spread_interval = max(spread_interval, interval)
        self._spread_endpoints = spread_endpoints
        #: The wait before the next batch: `spread_interval` after a batch over
        #: more than `spread_endpoints` endpoints, else `interval`.
        self.next_wait = interval
        self._max_batch = max_batch
        self._max_queued = max_queued
        self._on_start = on_thread_start
        self._on_stop = on_thread_stop
        self._queue: deque[Any] = deque()
        self._wake = threading.Event()
        self._stop_wait = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.written = 0
        self.dropped = 0
        #: Unwritten at stop, kept by the journal for the next start.
        self.kept = 0
        self._counted_at_stop = False
        self._stop_count_lock = threading.Lock()
        self.failed_batches = 0
        self._sealed: list[Path] = []
        self._held: list[Any] = []
        #: Entries of the batch being written now: still unwritten, so they count
        #: towards `max_queued` (the batch becomes `_held` if the database is down).
        self._in_flight = 0
        self._outage = Outage(max_queued)
        self._overflowing = False
        self._barriers = 0   # WriteBarriers queued (service.http.write_barrier)

    @property
    def pending(self) -> int:
        """Entries not yet written: queued, being written, or held back by a batch
        that found the database unreachable (the buffer while it is down)."""
        return len(self._queue) + self._in_flight + len(self._held)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="logic-records", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stopping

    def put_barrier(self, barrier: Any) -> None:
        """Queue `barrier` (`service.http.write_barrier`) and wake the writer: its
        `release()` is called once everything queued before it is done with."""
        self._barriers += 1
        self._queue.append(barrier)
        self._wake.set()

    def put(self, entry: Any) -> None:
        """Queue a finished request (or a record item); never blocks.

        When the writer is `max_queued` behind (the database is down or far
        too slow), or was stopped, the entry is dropped and counted instead.
        """
        queue = self._queue
        if len(queue) + self._in_flight + len(self._held) >= self._max_queued or self._stopping:
            self.dropped += 1
            if not self._overflowing and not self._stopping:
                self._overflowing = True  # once per episode: not a line per request
                log.warning("the records buffer is full (%d waiting): records of further "
                            "requests are dropped and counted until it drains", self.pending)
            return
        journal = self._journal
        facts = getattr(entry, "journal_facts", None) if journal is not None else None
        if journal is not None and facts is not None:
            # Journaled as it is queued (service.http.journal): a crash of the
            # process loses nothing that was answered.
            entry = JournaledRequest(facts())
            with journal.lock:
                try:
                    entry.mark = journal.append(entry.facts)
                except OSError as err:
                    self._journal_failed(err)
                queue.append(entry)
        else:
            queue.append(entry)  # deque.append is atomic: no lock needed
        if len(queue) >= self._max_batch:
            self._wake.set()

    def _journal_failed(self, err: OSError) -> None:
        self._journal_errors += 1
        if self._journal_errors in (1, 10, 100) or self._journal_errors % 1000 == 0:
            log.warning("writing the records journal failed (%d times): %s",
                        self._journal_errors, err.strerror or err)

    def stop(self, timeout: float = 30.0) -> None:
        """Write everything queued, then end the thread. If it is still busy
        after `timeout` (a write that does not end), what it has not written
        is counted now: dropped, or kept by the journal."""
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        self._stop_wait.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._count_unwritten(self.pending, f"the records writer is still writing after "
                                                f"{timeout:g} s")
        self._thread = None

    def _count_unwritten(self, left: int, why: str) -> None:
        """At stop (once): `left` records are not written by this process."""
        with self._stop_count_lock:   # the thread and `stop` may both get here
            if self._counted_at_stop:
                return
            self._counted_at_stop = True
        if not left:
            return
        log.warning("stopping with %d records unwritten (%s)%s", left, why,
                    "; the journal keeps them" if self._journal else "")
        if self._journal is None:
            self.dropped += left
        else:
            self.kept += left

    @property
    def database_down(self) -> bool:
        """True from a failed write that found the database unreachable to the next success."""
        return self._outage.down

    def _run(self) -> None:
        if self._on_start:
            try:
                self._on_start()
            except Exception as err:  # noqa: BLE001 - the first batch connects again
                # The database was unreachable as the writer started: it writes
                # (connecting again) at its first batch, as after any outage;
                # before, the thread ended here and nothing was ever written.
                log.warning("the records writer could not connect at its start (%s): it "
                            "tries again with its first batch", type(err).__name__)
        try:
            while True:
                if not self._outage.down:
                    self._wake.wait(self.next_wait)
                else:  # a full queue must not make the writer hammer a database that is down
                    self._stop_wait.wait(self._outage.retry_s)
                self._wake.clear()
                stopping = self._stopping  # read before draining: nothing is left behind
                if self._outage.down and self._held and not stopping:
                    # Probe with the held batch alone: no journal segment is
                    # sealed (kept open and mapped) per turn of a long outage.
                    if self._flush(self._held):
                        continue
                    self._held = []
                queued, sealed = self._seal()
                self._sealed += sealed
                # What is queued now, in batches of at most max_batch; entries
                # arriving meanwhile wait for the next turn (or the final drain).
                ok = self._write(queued)
                if stopping and ok:
                    queued, more = self._seal()
                    self._sealed += more
                    while self._queue and ok:
                        ok = self._write(len(self._queue))
                self._settle(ok)
                if stopping:
                    for barrier in [e for e in self._queue if type(e) is WriteBarrier]:
                        self._queue.remove(barrier)
                        barrier.release(False)
                    if self._held:
                        self._queue.extendleft(reversed(self._held))
                        self._held = []
                    # The database is down at shutdown: the journal keeps them
                    # for the next start (without one they are lost, counted).
                    self._count_unwritten(len(self._queue), "the database is unreachable")
                    if self._journal is not None:
                        self._journal.close()
                        if not self._queue and self._forget_run is not None:
                            self._forget(self._journal.run)
                    return
        finally:
            if self._on_stop:
                self._on_stop()

    def _write(self, count: int) -> bool:
        """Write what a failed turn held back, then the oldest `count` queued entries;
        False at the first batch that failed.

        A batch that found the database unreachable is held and written first
        next time: while the database is down the queue and that batch are the
        buffer (together at most `max_queued`), written in order once it is back.
        """
        if self._held:
            if self._flush(self._held):
                return False
            self._held = []
        while count > 0:
            # In `pending` from before the queue shrank (`_take_up_to` counts
            # it) until it is held or written: the bound holds during a write.
            batch = self._take_up_to(count)
            count -= len(batch)
            barriers = [e for e in batch if type(e) is WriteBarrier] if self._barriers else []
            if barriers:
                self._barriers -= len(barriers)
                batch = [e for e in batch if type(e) is not WriteBarrier]
            held = False
            try:
                held = bool(batch) and self._flush(batch)
                if held:
                    self._held = batch
                    return False
            finally:
                self._in_flight = 0
                for barrier in barriers:
                    barrier.release(not held)
        return True

    def _seal(self) -> tuple[int, list[Path]]:
        """How many entries are queued now, and the journal segments holding them."""
        journal = self._journal
        if journal is None:
            return len(self._queue), []
        with journal.lock:
            return len(self._queue), journal.seal()

    def _settle(self, ok: bool) -> None:
        if self._journal is not None and self._sealed and ok:
            self._journal.discard(self._sealed)
            self._sealed = []
        # else: kept until everything they hold is written (or replayed at the next start)

    def _forget(self, run: str) -> None:
        """Everything journaled is written: the run's mark is of no more use."""
        assert self._forget_run is not None
        try:
            self._forget_run(run)
        except Exception:  # noqa: BLE001 - a leftover mark is harmless (and expires)
            log.debug("the records journal's mark was not deleted", exc_info=True)

    def _store(self, items: list[Any], mark: Any) -> None:
        """One transaction: `items`, and the journal mark of the entries they came from."""
        if mark is None:
            self._write_batch(items)
        else:
            self._write_batch(items, mark)

    def _take_up_to(self, n: int) -> list[Any]:
        queue = self._queue
        take = min(n, len(queue), self._max_batch)
        self._in_flight = take   # first: a put() meanwhile sees them in `pending`
        return [queue.popleft() for _ in range(take)]

    def _flush(self, batch: list[Any]) -> bool:
        """Write `batch`; True when it must stay queued (the database is unreachable).

        Any other error is retried twice, then each entry is written alone
        and only those that fail alone are dropped and counted (an entry that
        can never be written must neither stop the writer nor cost the other
        guilds' records in its batch).
        """
        started = time.monotonic()
        for attempt in range(3):
            try:
                items = expand(batch)
                self._store(items, mark_of(batch))
            except (OperationalError, InterfaceError) as err:
                self._outage.began(err, len(batch), self.dropped)
                return True
            except Exception:  # noqa: BLE001 - a bad batch must not kill the writer
                log.warning("writing %d records failed (attempt %d)", len(batch), attempt + 1,
                            exc_info=True)
                if attempt < 2:
                    time.sleep(0.1 * (attempt + 1))
                continue
            if self._outage.down:
                self._outage.ended(self.dropped)  # before `written` moves: whoever waits sees it
            self.written += len(batch)
            self._overflowing = False
            self._pace(items)
            log.debug("wrote %d entries in %.1f ms", len(batch),
                      (time.monotonic() - started) * 1000)
            return False
        self.failed_batches += 1
        return self._write_each(batch)

    def _write_each(self, batch: list[Any]) -> bool:
        """`_flush`'s last resort: every entry alone, dropping those that fail.

        True when the database became unreachable meanwhile: `batch` then
        holds only the entries not yet written, to be held and retried."""
        for i, entry in enumerate(batch):
            try:
                self._store(expand([entry]), mark_of([entry]))
            except (OperationalError, InterfaceError) as err:
                del batch[:i]
                self._outage.began(err, len(batch), self.dropped)
                return True
            except Exception:  # noqa: BLE001 - as in _flush
                log.warning("a record could not be written; dropped", exc_info=True)
                self.dropped += 1
                continue
            self.written += 1
        return False

    def _pace(self, items: list[Any]) -> None:
        """Choose the next wait from the endpoints the batch just written spanned."""
        if len(items) <= self._spread_endpoints:
            self.next_wait = self._interval   # cannot span more endpoints than items
            return
        endpoints = {getattr(item, "endpoint_id", None) for item in items}
        self.next_wait = (self._spread_interval if len(endpoints) > self._spread_endpoints
                          else self._interval)
