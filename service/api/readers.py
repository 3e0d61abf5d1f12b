"""The admin API's heavy reads (history, error log, statistics) in their own processes.

A history page or the statistics of an endpoint cost a few milliseconds of
pure Python (query building, rows to JSON shapes). In a thread of the
service's process that time holds the GIL, so a client reading in a loop
took up to half of the event loop's time, whatever the thread's priority
(docs/performance.md, "Admin API next to the invoke path"). Here those calls
run in `READ_PROCESSES` separate processes, started with `spawn` (a fresh
interpreter: nothing of the event loop, the sandbox pool or a thread is
inherited) and running at the lowest CPU priority (`nice` 19): under load they
take only CPU the invoke path does not want, and an invocation never waits
for them.

The functions are the service layer's own (`service.core.pages`,
`service.core.reads`), called with the same arguments; each process opens
its own database connection from the service's URL. Results and service-layer
errors come back pickled. A process that dies is replaced with the pool;
the call that was running gets 503 `busy`.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, TypeVar

from service.http.errors import BusyError

log = logging.getLogger("logic.api")
T = TypeVar("T")

#: Reading processes per front process.
READ_PROCESSES = 2
#: Their CPU priority below the service's (Linux nice value added).
READ_NICENESS = 19


class ReadProcesses:
    """A small pool of reading processes for one database URL."""

    def __init__(self, database_url: str, processes: int = READ_PROCESSES) -> None:
        self._url = database_url
        self.processes = processes
        self._executor: ProcessPoolExecutor | None = None

    @staticmethod
    def usable(database_url: str) -> bool:
        """Whether another process can open this database (not SQLite in memory)."""
        return ":memory:" not in database_url and "mode=memory" not in database_url

    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None:
            self._executor = ProcessPoolExecutor(
                max_workers=self.processes, mp_context=multiprocessing.get_context("spawn"),
                initializer=_start, initargs=(self._url, _file_identity()))
        return self._executor

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in a reading process; raises what `fn` raises,
        or `BusyError` when the process running it died."""
        # Read-only mappings (the plan table) do not pickle: send plain dicts.
        kwargs = {k: dict(v) if isinstance(v, Mapping) and not isinstance(v, dict) else v
                  for k, v in kwargs.items()}
        loop = asyncio.get_running_loop()
        try:
            future = self._pool().submit(_call, fn, args, kwargs)
            return await asyncio.wrap_future(future, loop=loop)
        except BrokenProcessPool:
            log.warning("an admin API reading process died; starting new ones")
            broken, self._executor = self._executor, None
            if broken is not None:
                broken.shutdown(wait=False, cancel_futures=True)
            raise BusyError("The service could not answer this read; retry shortly.",
                            headers={"Retry-After": "1"}) from None

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def _file_identity() -> tuple[int, int] | None:
    """The SQLite file the service opened: a reading process started after
    another file was put in its place refuses it (`models.db`)."""
    from models.db import database
    return getattr(database.obj, "identity", None)


def _start(database_url: str, identity: tuple[int, int] | None = None) -> None:
    """In a new reading process: lower priority, the service's database."""
    try:
        os.nice(READ_NICENESS)
    except OSError:  # not permitted: best effort
        pass
    from models.db import connect
    connect(database_url, create=False, identity=identity)


def _call(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
    # The process keeps its connection between calls (peewee reopens a
    # PostgreSQL connection the server dropped, outside a transaction).
    return fn(*args, **kwargs)
