"""A plain FIFO queue with `sandbox.scheduler.Scheduler`'s interface: the pool's
queue without tenancy (no per-guild share, no round robin, no budget).

Reference for `bench/scheduler_bench.py`: what the fair scheduler costs
against the queue it replaced.  Not used by the service.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Callable


class Scheduler:
    def __init__(self, size: int, share: float = 0.5, budget_s: float = 60.0,
                 window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.size = size
        self.share = share
        self.cap = size
        self.budget = float(budget_s)
        self.rate = 0.0
        self.clock = clock
        self.running = 0
        self.excess = 0
        self.waiting = 0
        self.guilds: dict[str, Any] = {}
        self._q: OrderedDict[Any, None] = OrderedDict()

    def start(self, guild: str) -> int:
        if self.running >= self.size:
            return -1
        self.running += 1
        return 0

    def finish(self, guild: str, cost_s: float, excess: bool = False) -> bool:
        self.running -= 1
        return False

    def push(self, req: Any, resume: bool = False) -> bool:
        self._q[req] = None
        if resume:
            self._q.move_to_end(req, last=False)
        req.queued = True
        req.deprioritised = False
        self.waiting += 1
        return self.running < self.size

    def pop(self) -> Any:
        if not self.waiting or self.running >= self.size:
            return None
        req, _ = self._q.popitem(last=False)
        req.queued = False
        req.excess = False
        self.waiting -= 1
        self.running += 1
        return req

    def cancel(self, req: Any) -> bool:
        if not req.queued:
            return False
        del self._q[req]
        req.queued = False
        self.waiting -= 1
        return True

    def standing(self, guild: str) -> float:
        return self.budget

    def sweep(self) -> None:
        pass
