"""A lookup's query on a lookup thread, bounded from its start (`TargetCache.fetch`).

A query unanswered `limit` seconds after its thread began it counts as a lost
connection (`LookupStalled`): a server, proxy or network that keeps the
connection open but answers nothing. Its socket is then shut through the
duplicate the thread keeps while the query runs (`shut`), which ends the
query and frees the thread. Time spent waiting for a thread is not the
server's: past `QUEUE_WAIT_TIMEOUTS` limits of it the lookup is refused
(`Backlogged`), and no outage is declared.
"""
from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any

#: A lookup still waiting for a lookup thread after this many limits (`lookup_timeout_s`)
#: is refused (`TargetsUnavailable`): the queries are slow, not lost.
QUEUE_WAIT_TIMEOUTS = 4


class LookupStalled(Exception):
    """A lookup's query got no answer within its limit of its start."""


class Query:
    """One lookup's query: when its thread began it, a copy of its socket
    meanwhile (`shut`), and whether the loop gave up on it before it began."""

    __slots__ = ("started", "held", "abandoned")

    def __init__(self) -> None:
        self.started: float | None = None
        self.held: list[int] = []
        self.abandoned = False


class Backlogged(Exception):
    """A lookup waited too long for a lookup thread."""


#: `TargetCache._query`'s answer when it did not query (given up on, or an outage began).
SKIPPED = object()


async def answer_of(query: Query, future: asyncio.Future[Any], limit: float) -> Any:
    """The query's answer; `LookupStalled` when it ran `limit` seconds
    without one, `Backlogged` when it waited too long for a thread (the
    time a lookup waits for a thread is not the server's)."""
    queued_at = time.monotonic()
    while True:
        now = time.monotonic()
        if query.started is None:
            left = queued_at + QUEUE_WAIT_TIMEOUTS * limit - now
            if left <= 0:
                query.abandoned = True
                raise Backlogged()
            left = min(left, limit)
        else:
            left = query.started + limit - now
            if left <= 0:
                raise LookupStalled()
        try:
            return await asyncio.wait_for(asyncio.shield(future), left)
        except asyncio.TimeoutError:
            continue


def shut(held: list[int]) -> None:
    """End a stalled query: shut its socket (through the duplicate in `held`),
    so that its thread's read fails now instead of when TCP gives up."""
    try:
        fd = held.pop()
    except IndexError:
        return   # the query ended meanwhile
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        return
    with sock:   # closes the duplicate
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def retrieve(future: asyncio.Future[Any]) -> None:
    """A query given up on may still end in an error: it is not reported."""
    if not future.cancelled():
        future.exception()


def close_held(held: list[int]) -> None:
    try:
        os.close(held.pop())
    except IndexError:
        pass   # `shut` took it


async def feed_noticed(feed: Any, bound_s: float) -> None:
    """Until the change feed no longer listens, `bound_s` at most."""
    deadline = time.monotonic() + bound_s
    while feed.healthy and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
