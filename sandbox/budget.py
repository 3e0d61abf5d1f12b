"""The pool's memory budget: what a worker is charged, and how many workers it allows.

Each worker is charged ``WORKER_BYTES`` plus what it reported it grew since
its first job (``sandbox.placement`` keeps the estimate under
``memory_budget``); by default the budget is half of the machine's memory,
or of the cgroup's limit if lower, and ``max_workers`` as many workers as it
holds, bounded by the descriptors the service may open.
"""
from __future__ import annotations

import os
import resource


#: What one idle worker costs beyond the pages it shares with the fork server:
#: ~4 MiB of private memory measured after its first jobs (USS), plus page
#: tables and kernel structures.  Growth it reports after a job comes on top.
WORKER_BYTES = 5 << 20
#: Descriptors the service holds per worker (its channel and its pidfd).
WORKER_FDS = 2


def physical_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit if lower."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 4 << 30
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = int(f.read().strip())
        except (OSError, ValueError):   # absent, or "max"
            continue
        if 0 < limit < memory:
            memory = limit
    return memory


def derived_memory_budget() -> int:
    """Default ``memory_budget``: half of :func:`physical_memory`."""
    return physical_memory() // 2


def derived_max_workers(size: int, memory_budget: int | None = None) -> int:
    """Default ``max_workers``: as many workers as the memory budget holds at
    ``WORKER_BYTES`` each, at least ``2 * size``, at most 4096 and at most what
    a quarter of the descriptor limit allows."""
    budget = memory_budget or derived_memory_budget()
    try:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    except (ValueError, OSError):
        nofile = 1024
    if nofile == resource.RLIM_INFINITY:
        nofile = 1 << 20
    by_fds = nofile // 4 // WORKER_FDS
    return max(2 * size, min(4096, budget // WORKER_BYTES, by_fds))
