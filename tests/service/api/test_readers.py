"""History, error log and statistics run in the API's reading processes
(service/api/readers.py): separate, lower-priority processes, so their Python
work never holds the event loop's GIL; one that dies is replaced."""
from __future__ import annotations

import os
import signal

import psutil

from tests.service.api.conftest import assert_error
from tests.service.http.harness import wait_until


def _readers(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=False)
            if "multiprocessing" in " ".join(p.cmdline())
            and "resource_tracker" not in " ".join(p.cmdline())]


def test_reads_run_in_lower_priority_processes_that_are_replaced(server, world) -> None:
    w = world()
    stats = w.script_path + "/stats"
    assert w.owner("GET", stats).status == 200
    assert server.proc is not None
    readers = _readers(server.proc.pid)
    assert readers, "no reading process was started"
    own_nice = psutil.Process(server.proc.pid).nice()
    assert all(p.nice() >= own_nice + 10 for p in readers)

    # A reading process that dies: the call it ran (if any) is 503 busy, the
    # next ones are answered by new processes; nothing else is affected.
    for p in readers:
        os.kill(p.pid, signal.SIGKILL)
    statuses = []

    def answered() -> bool:
        resp = w.owner("GET", stats)
        statuses.append(resp.status)
        if resp.status == 503:
            assert_error(resp, 503, "busy")
        return resp.status == 200

    assert wait_until(answered, timeout=30), statuses
    assert set(statuses) <= {200, 503}
    assert w.owner("GET", w.script_path + "/history").status == 200
    fresh = _readers(server.proc.pid)
    assert fresh and not {p.pid for p in fresh} & {p.pid for p in readers}
