"""The batched history / error-log / statistics writer of the invoke path.

Handlers hand finished requests to `RecordWriter.put()`, which only appends to
a deque: no database work, no lock and no thread wake-up on the event loop.
One background thread wakes every `interval` seconds (sooner when `max_batch`
entries are waiting), takes everything queued and writes it in one transaction
through the service layer. `stop()` writes everything still queued, so a
SIGTERM loses no record; with a `Journal` (as `logic serve` runs it) a crash
of the process loses none either (service.http.journal).

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from service.http.journal import Journal, JournaledRequest

log = logging.getLogger("logic.records")


class Recordable(Protocol):
    """A finished request that knows its records (see `service.http.invoke.InvokeRequest`)."""

    def history_slot(self) -> tuple[int, int] | None:
        """(endpoint id, history size of its plan) if it goes to history, else None."""

    def records(self, history: bool) -> list[Any]:
        """Its record items; the history record only if `history`."""


def expand(entries: Sequence[Any]) -> list[Any]:
    """Record items for a batch: history only for each endpoint's newest N entries.

    Plain items (anything without `records`) pass through unchanged. The
    newest entry of an endpoint carries its current plan's N.
    """
    left: dict[int, int] = {}
    out: list[list[Any]] = []
    for entry in reversed(entries):
        convert = getattr(entry, "records", None)
        if convert is None:
            out.append([entry])
            continue
        try:
            slot = entry.history_slot()
            history = False
            if slot is not None:
                endpoint_id, keep = slot
                n = left.setdefault(endpoint_id, keep)
                if n > 0:
                    left[endpoint_id] = n - 1
                    history = True
            out.append(convert(history))
        except Exception:  # noqa: BLE001 - one bad entry must not cost the batch
            log.error("a request could not be turned into records; skipped", exc_info=True)
    out.reverse()
    return [item for items in out for item in items]


class RecordWriter:
    """A single background thread that writes queued records in batches."""

    def __init__(
        self,
        write_batch: Callable[[Sequence[Any]], None],
        *,
        interval: float = 0.25,
        max_batch: int = 20_000,
        max_queued: int = 200_000,
        on_thread_start: Callable[[], object] | None = None,
        on_thread_stop: Callable[[], object] | None = None,
        journal: Journal | None = None,
    ) -> None:
        self._journal = journal
        self._journal_errors = 0
        self._write_batch = write_batch
        self._interval = interval
        self._max_batch = max_batch
        self._max_queued = max_queued
        self._on_start = on_thread_start
        self._on_stop = on_thread_stop
        self._queue: deque[Any] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.written = 0
        self.dropped = 0
        self.failed_batches = 0

    @property
    def pending(self) -> int:
        """Entries queued and not yet taken by the writer thread."""
        return len(self._queue)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="logic-records", daemon=True)
        self._thread.start()

    def put(self, entry: Any) -> None:
        """Queue a finished request (or a record item); never blocks.

        When the writer is `max_queued` behind (the database is down or far
        too slow), or was stopped, the entry is dropped and counted instead.
        """
        queue = self._queue
        if len(queue) >= self._max_queued or self._stopping:
            self.dropped += 1
            return
        journal = self._journal
        facts = getattr(entry, "journal_facts", None) if journal is not None else None
        if journal is not None and facts is not None:
            # Journaled as it is queued (service.http.journal): a crash of the
            # process loses nothing that was answered.
            entry = JournaledRequest(facts())
            with journal.lock:
                try:
                    journal.append(entry.facts)
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
        """Write everything queued, then end the thread."""
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        if self._on_start:
            self._on_start()
        try:
            while True:
                self._wake.wait(self._interval)
                self._wake.clear()
                stopping = self._stopping  # read before draining: nothing is left behind
                queued, sealed = self._seal()
                # What is queued now, in batches of at most max_batch; entries
                # arriving meanwhile wait for the next turn (or the final drain).
                ok = True
                for _ in range(-(-queued // self._max_batch)):
                    ok = self._flush(self._take()) and ok
                if stopping:
                    queued, more = self._seal()
                    sealed += more
                    while self._queue:
                        ok = self._flush(self._take()) and ok
                self._settle(sealed, ok)
                if stopping:
                    if self._journal is not None:
                        self._journal.close()
                    return
        finally:
            if self._on_stop:
                self._on_stop()

    def _seal(self) -> tuple[int, list[Path]]:
        """How many entries are queued now, and the journal segments holding them."""
        journal = self._journal
        if journal is None:
            return len(self._queue), []
        with journal.lock:
            return len(self._queue), journal.seal()

    def _settle(self, sealed: list[Path], ok: bool) -> None:
        if self._journal is not None and sealed and ok:
            self._journal.discard(sealed)
        # else: a batch failed; its segments stay and are replayed at the next start-up

    def _take(self) -> list[Any]:
        queue = self._queue
        batch = []
        for _ in range(min(len(queue), self._max_batch)):
            batch.append(queue.popleft())
        return batch

    def _flush(self, batch: list[Any]) -> bool:
        started = time.monotonic()
        for attempt in range(3):
            try:
                self._write_batch(expand(batch))
                self.written += len(batch)
                log.debug("wrote %d entries in %.1f ms", len(batch),
                          (time.monotonic() - started) * 1000)
                return True
            except Exception:  # noqa: BLE001 - a bad batch must not kill the writer
                log.warning("writing %d records failed (attempt %d)", len(batch), attempt + 1,
                            exc_info=True)
                if attempt < 2:
                    time.sleep(0.1 * (attempt + 1))
        self.failed_batches += 1
        self.dropped += len(batch)
        return False
