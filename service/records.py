"""The batched history / error-log / statistics writer of the invoke path.

Handlers hand finished records to `RecordWriter.put()`, which only appends to a
queue: no database work on the event loop. One background thread drains the
queue in batches (up to `batch_size` items or `interval` seconds) and writes
each batch in one transaction through the service layer. `stop()` flushes
everything still queued, so a SIGTERM loses no record.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("logic.records")

_STOP = object()


class RecordWriter:
    """A single background thread that writes queued records in batches."""

    def __init__(
        self,
        write_batch: Callable[[Sequence[Any]], None],
        *,
        batch_size: int = 500,
        interval: float = 0.05,
        max_queued: int = 200_000,
        on_thread_start: Callable[[], object] | None = None,
        on_thread_stop: Callable[[], object] | None = None,
    ) -> None:
        self._write_batch = write_batch
        self._batch_size = batch_size
        self._interval = interval
        self._max_queued = max_queued
        self._on_start = on_thread_start
        self._on_stop = on_thread_stop
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.written = 0
        self.dropped = 0
        self.failed_batches = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="logic-records", daemon=True)
        self._thread.start()

    def put(self, *items: Any) -> None:
        """Queue records for writing; never blocks (drops, counted, when far behind)."""
        if self._queue.qsize() >= self._max_queued:
            self.dropped += len(items)
            return
        for item in items:
            self._queue.put(item)

    def stop(self, timeout: float = 30.0) -> None:
        """Write everything queued, then end the thread."""
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        if self._on_start:
            self._on_start()
        try:
            stopping = False
            while True:
                batch: list[Any] = []
                deadline = time.monotonic() + self._interval
                while len(batch) < self._batch_size:
                    try:
                        if stopping:
                            # After a stop request, drain what is left without waiting.
                            item = self._queue.get_nowait()
                        elif batch:
                            item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                        else:
                            item = self._queue.get()
                    except queue.Empty:
                        break
                    if item is _STOP:
                        stopping = True
                    else:
                        batch.append(item)
                if batch:
                    self._flush(batch)
                elif stopping:
                    return
        finally:
            if self._on_stop:
                self._on_stop()

    def _flush(self, batch: list[Any]) -> None:
        for attempt in range(3):
            try:
                self._write_batch(batch)
                self.written += len(batch)
                return
            except Exception:  # noqa: BLE001 - a bad batch must not kill the writer
                log.warning("writing %d records failed (attempt %d)", len(batch), attempt + 1,
                            exc_info=True)
                time.sleep(0.1 * (attempt + 1))
        self.failed_batches += 1
        self.dropped += len(batch)
