"""`Turns`: how many requests all connections of a front may begin in one turn
of the event loop, and who goes next when that is spent.

A connection begins at most REQUESTS_PER_TURN requests a turn of the loop
(`service.http.parsing`), but a turn grew with the connections flooding in it:
200 connections of one address, each pipelining cheap requests within its own
share, kept a new client unanswered for seconds (review, session 29). Here
the requests all connections begin are counted (by the parser, `used`);
once `budget` is spent, a connection with more to parse waits, and the next
turn of the loop starts the count anew and serves the waiting connections
round robin by peer address (the group of the per-address connection cap),
one connection of each address in turn, so that a client of another address
is served within a turn or two of being accepted, however many connections
one address floods with. Without a flood the count is never reset in between: then once in
`budget` requests a connection waits a turn it need not have (the price of
no callback per turn).
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from typing import Protocol

from service.http.wire import log


class Waiter(Protocol):
    peer_key: str
    closed: bool

    def next_turn(self) -> None: ...


class Turns:
    """Requests begun this turn of the loop, and the connections waiting for the next."""

    def __init__(self, loop: asyncio.AbstractEventLoop, budget: int) -> None:
        self.loop = loop
        self.budget = max(1, budget)
        #: Requests begun in this turn (read by the parser: `used >= budget`).
        self.used = 0
        self._scheduled = False
        self._waiting: OrderedDict[str, deque[Waiter]] = OrderedDict()
        self._queued: set[Waiter] = set()

    def wait(self, conn: Waiter) -> None:
        """`conn` has more to parse: it goes on at a later turn, in its address's turn."""
        if conn in self._queued:
            return
        self._queued.add(conn)
        group = self._waiting.get(conn.peer_key)
        if group is None:
            group = self._waiting[conn.peer_key] = deque()
        group.append(conn)
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._turn)

    @property
    def waiting(self) -> int:
        return len(self._queued)

    def _turn(self) -> None:
        """A new turn of the loop: the budget anew, and the waiting connections
        served, one per address in turn, while it lasts."""
        self._scheduled = False
        self.used = 0
        waiting = self._waiting
        try:
            while waiting and self.used < self.budget:
                key, group = next(iter(waiting.items()))
                conn = group.popleft()
                if group:
                    waiting.move_to_end(key)   # its next connection after the other addresses'
                else:
                    del waiting[key]
                self._queued.discard(conn)
                if not conn.closed:
                    conn.next_turn()   # may spend, and wait again (at the back)
        except Exception:  # noqa: BLE001 - one connection's fault must not stall the others
            log.exception("a connection's turn failed")
        finally:
            if waiting and not self._scheduled:
                self._scheduled = True
                self.loop.call_soon(self._turn)
