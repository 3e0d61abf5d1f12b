"""The service-layer threads run below the event loop's priority, and so do the
processes they start (a save's compile process): a flood of saves from the
dashboard or the admin API takes only CPU the invoke path does not want
(review, session 26: the dashboard's threads ran saves' compiles at nice 0)."""
from __future__ import annotations

import os
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from service.dashboard.base import Dashboard
from service.http.priority import background_executor
from service.settings import load_settings


def _niceness_seen(executor: ThreadPoolExecutor) -> tuple[int, int]:
    def probe() -> tuple[int, int]:
        own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        child = subprocess.run(["nice"], capture_output=True, text=True, check=True)
        return own, int(child.stdout)
    try:
        return executor.submit(probe).result(timeout=30)
    finally:
        executor.shutdown()


@pytest.mark.skipif(os.getpriority(os.PRIO_PROCESS, 0) != 0, reason="the test runs niced already")
def test_dashboard_calls_and_the_processes_they_start_run_at_nice_10() -> None:
    dashboard = Dashboard(load_settings(None, env={}))
    assert _niceness_seen(dashboard.executor) == (10, 10)
    assert os.getpriority(os.PRIO_PROCESS, 0) == 0    # the loop's own thread is untouched


@pytest.mark.skipif(os.getpriority(os.PRIO_PROCESS, 0) != 0, reason="the test runs niced already")
def test_background_executors_run_at_nice_10() -> None:
    assert _niceness_seen(background_executor(1, "probe")) == (10, 10)
