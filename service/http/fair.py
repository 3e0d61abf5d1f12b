"""`FairCalls`: calls share a few threads (or reading processes) by tenant.

A tenant is who calls: a user (whatever guilds they own or manage), the
operator, or an address whose API token is being looked up. A call waits in its
tenant's own queue, and a free thread takes the oldest call of the tenant
with the fewest calls running (the one waiting longest among equals). One
tenant never holds more than all threads but one: however many slow calls
one guild's manager sends (saves that spend the compile budget, large
statistics reads), another user's call finds a thread free at once, or the
next one to free up, never behind the flood. Calls are bounded per tenant
(`per_tenant`, running and waiting, then 503 busy for that tenant only) and
overall (`max_pending`): when every slot is taken, a call of a tenant with
at least two calls fewer than the tenant with the most makes room by
refusing that tenant's newest waiting call (503 busy), so a few tenants at
their own bound cannot turn everyone else away; only when no tenant has
that many more is the new call refused. The admin API and the dashboard
each share their threads this way (the dashboard's calls made before a
session is known, resuming one or logging in, go to its pool directly).
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from service.http.errors import BusyError

T = TypeVar("T")

_Waiting = tuple[Callable[[], Awaitable[Any]], "asyncio.Future[Any]"]


class FairCalls:
    """At most `capacity` calls at once, started from each tenant's queue in turn."""

    def __init__(self, capacity: int, max_pending: int, per_tenant: int,
                 name: str = "admin API") -> None:
        self.name = name   # what a refusal calls the calls ("admin API", "dashboard")
        self.capacity = capacity
        self.max_pending = max_pending
        self.per_tenant = per_tenant
        #: Tenants with calls waiting, in the order their turns come (a dict: a ring).
        self._waiting: dict[str, deque[_Waiting]] = {}
        self._running: dict[str, int] = {}
        self.pending = 0   # admitted and not finished: waiting or running

    def _busy(self, message: str) -> BusyError:
        return BusyError(message, headers={"Retry-After": "1"})

    async def run(self, tenant: str, start: Callable[[], Awaitable[T]]) -> T:
        """`await start()` once a thread is this tenant's; raises `BusyError` when
        too many calls (of everyone, or of this tenant) are waiting already."""
        queue = self._waiting.get(tenant)
        have = self._running.get(tenant, 0) + (len(queue) if queue else 0)
        if have >= self.per_tenant:
            raise self._busy(f"Too many of your {self.name} calls at once; retry shortly.")
        if self.pending >= self.max_pending and not self._make_room(have):
            raise self._busy(f"Too many {self.name} calls at once; retry shortly.")
        queue = self._waiting.get(tenant)
        ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending += 1
        try:
            if queue is None:
                queue = self._waiting[tenant] = deque()
            queue.append((start, ready))
            self._pump()
            return await ready   # type: ignore[no-any-return]
        finally:
            self.pending -= 1

    def _make_room(self, have: int) -> bool:
        """Every slot is taken: refuse the newest waiting call of the tenant with
        the most calls, if it has at least two more than ``have`` (O(tenants
        waiting), only while full). False when no tenant has."""
        while True:
            top, most = None, have + 1
            for name, queue in self._waiting.items():
                calls = self._running.get(name, 0) + len(queue)
                if calls > most:
                    top, most = name, calls
            if top is None:
                return False
            queue = self._waiting[top]
            while queue:
                _, ready = queue.pop()
                if not ready.done():   # (one whose caller went away frees no place)
                    if not queue:
                        del self._waiting[top]
                    # Its caller's `run` counts it out of `pending` as it wakes.
                    ready.set_exception(self._busy(
                        f"Too many {self.name} calls at once; retry shortly."))
                    return True
            del self._waiting[top]

    def _pump(self) -> None:
        """Start waiting calls while threads are free, one tenant's turn after another."""
        while sum(self._running.values()) < self.capacity and self._waiting:
            # The tenant with the fewest calls running goes first (the longest
            # waiting of them); none takes more than all threads but one.
            chosen, fewest = None, self.capacity - 1 if self.capacity > 1 else 1
            for tenant in self._waiting:
                running = self._running.get(tenant, 0)
                if running < fewest:
                    chosen, fewest = tenant, running
            if chosen is None:
                return
            queue = self._waiting.pop(chosen)
            start, ready = queue.popleft()
            if queue:
                self._waiting[chosen] = queue   # to the back of the ring
            if ready.done():                    # its caller went away meanwhile
                continue
            try:
                task = asyncio.ensure_future(start())
            except Exception as err:   # noqa: BLE001 - e.g. an executor shut down: its caller's
                ready.set_exception(err)
                continue
            self._running[chosen] = self._running.get(chosen, 0) + 1
            task.add_done_callback(functools.partial(self._finished, chosen, ready))

    def _finished(self, tenant: str, ready: asyncio.Future[Any], done: asyncio.Future[Any]) -> None:
        left = self._running[tenant] - 1
        if left:
            self._running[tenant] = left
        else:
            del self._running[tenant]
        if not ready.done():
            if done.cancelled():
                ready.cancel()
            elif done.exception() is not None:
                ready.set_exception(done.exception())   # type: ignore[arg-type]
            else:
                ready.set_result(done.result())
        elif not done.cancelled():
            done.exception()   # retrieved: a caller that went away logs nothing
        self._pump()
