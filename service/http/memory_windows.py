"""Moving windows of hit times in this process's memory (`memory://` storage).

The interface every window store of `service.http.ratelimit` has (the shared
table of several front processes, `shared_windows.SharedWindows`, derives
from it; `redis_windows.RedisWindows` has it as coroutines): `hit`, `peek`,
`refund`.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Union

WINDOW_S = 60.0

#: What identifies one counted hit in its window: its time (memory, the shared
#: table) or its entry as stored (Redis); None: no hit was counted.
Stamp = Union[float, str, None]


class MemoryWindows:
    """Moving windows: one deque of hit times per key (memory:// storage)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._hits: dict[str, deque[float]] = {}
        self._ops = 0

    def _window(self, key: str, now: float) -> deque[float] | None:
        q = self._hits.get(key)
        if q is not None:
            edge = now - WINDOW_S
            while q and q[0] <= edge:
                q.popleft()
        return q

    def hit(self, key: str, limit: int) -> tuple[bool, int, float, Stamp]:
        """Count a hit if a slot is free: (allowed, hits in window, oldest hit
        time, the hit's own stamp or None)."""
        now = self._clock()
        self._ops += 1
        if self._ops % 10_000 == 0:
            self._sweep(now)
        q = self._window(key, now)
        if q is None:
            q = self._hits[key] = deque()
        allowed = len(q) < limit
        if allowed:
            q.append(now)
        return allowed, len(q), q[0] if q else now, now if allowed else None

    def peek(self, key: str, limit: int) -> tuple[int, float]:
        now = self._clock()
        q = self._window(key, now)
        return (len(q), q[0]) if q else (0, now)

    def refund(self, key: str, limit: int, stamp: Stamp) -> None:
        """Take back the hit of ``key`` that `hit` stamped ``stamp`` (nothing if
        it already left the window). Its own, not the newest: a later request's
        hit taken back instead would leave the window early and this one late,
        admitting more than the limit in some 60 s."""
        q = self._hits.get(key)
        if not q or not isinstance(stamp, float):
            return
        for i in range(len(q) - 1, -1, -1):   # refunds follow their hit closely: from the newest
            if q[i] == stamp:
                del q[i]
                return
            if q[i] < stamp:
                return

    def _sweep(self, now: float) -> None:
        """Forget keys with no hit in the window, so memory follows active keys only."""
        for key in [k for k, q in self._hits.items() if not q or q[-1] <= now - WINDOW_S]:
            del self._hits[key]
