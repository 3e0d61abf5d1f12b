"""Threads below the event loop's priority.

The service-layer threads (argon2 hashing, the admin API's and the
dashboard's calls, and the save-time compile processes they start, which
inherit their thread's nice value) run at nice 10: a flood of unknown
secrets or of script saves then takes only CPU the invoke path does not want.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor


def background_priority() -> None:
    """Run this thread below the event loop's priority (Linux: per-thread nice)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not permitted: best effort
        pass


def background_executor(threads: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run at `background_priority`."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name,
                              initializer=background_priority)
