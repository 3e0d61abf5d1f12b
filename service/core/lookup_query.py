"""A lookup's query on a lookup thread, bounded from its start (`TargetCache.fetch`).

A query unanswered `limit` seconds after its thread began it is given up on
(`models.db_watch`): never retried by the database's automatic reconnect,
cancelled on the server, and its answer awaited `CANCEL_WAIT_S` more. A
server that is up (the query waited on a lock) answers with the cancel's
error: that lookup is refused, no outage. No answer by then counts as a lost
connection (`LookupStalled`): a server, proxy or network that keeps the
connection open but answers nothing. Its socket is then shut, which ends the
query and frees the thread. Time spent waiting for a thread is not
the server's: past `QUEUE_WAIT_TIMEOUTS` limits of it the lookup is refused
(`Backlogged`), and no outage is declared.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from models.db_watch import CANCEL_GRACE_S, StatementWatch

#: A lookup still waiting for a lookup thread after this many limits (`lookup_timeout_s`)
#: is refused (`TargetsUnavailable`): the queries are slow, not lost.
QUEUE_WAIT_TIMEOUTS = 4
#: A query given up on: its answer (the cancel's error, from a server that is
#: up) awaited this long, its cancel included, before it counts as stalled.
CANCEL_WAIT_S = CANCEL_GRACE_S + 0.25


class LookupStalled(Exception):
    """A lookup's query got no answer within its limit of its start."""


class Query(StatementWatch):
    """One lookup's query: when its thread began it, and what giving up on it
    needs (`StatementWatch`: its connection, its socket, whether the loop gave
    up on it, before it began or after)."""

    def __init__(self, server_timeout_s: float | None = None) -> None:
        super().__init__(server_timeout_s)
        self.started: float | None = None


class Backlogged(Exception):
    """A lookup waited too long for a lookup thread."""


#: `TargetCache._query`'s answer when it did not query (given up on, or an outage began).
SKIPPED = object()


async def answer_of(query: Query, future: asyncio.Future[Any], limit: float) -> Any:
    """The query's answer (or error); `LookupStalled` when it ran `limit`
    seconds without one and the cancel brought none (`given_up`),
    `Backlogged` when it waited too long for a thread (the time a lookup
    waits for a thread is not the server's)."""
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
                return await given_up(query, future)
        try:
            return await asyncio.wait_for(asyncio.shield(future), left)
        except asyncio.TimeoutError:
            continue


async def given_up(query: Query, future: asyncio.Future[Any]) -> Any:
    """The query ran its limit without an answer: never retried, cancelled on
    the server (on a thread of its own: the cancel connects), and its own
    outcome taken if it comes within `CANCEL_WAIT_S` (a server that is up
    answers the cancel at once); else its socket is shut: `LookupStalled`."""
    if query.abandon():   # else it ended meanwhile: its outcome is on its way
        threading.Thread(target=query.cancel, name="logic-lookup-cancel", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(future), CANCEL_WAIT_S)
    except asyncio.TimeoutError:
        query.shut()
        raise LookupStalled() from None


def retrieve(future: asyncio.Future[Any]) -> None:
    """A query given up on may still end in an error: it is not reported."""
    if not future.cancelled():
        future.exception()


async def feed_noticed(feed: Any, bound_s: float) -> None:
    """Until the change feed no longer listens, `bound_s` at most."""
    deadline = time.monotonic() + bound_s
    while feed.healthy and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


def say_refused(log: logging.Logger, err: BaseException, cancelled_after: float | None) -> None:
    """The line for a lookup the server refused (once per episode); `cancelled_after`:
    it was cancelled after that many seconds unanswered (`given_up`)."""
    # The error's kind and SQLSTATE only: its text may carry the server's address.
    orig = err.args[0] if err.args and isinstance(err.args[0], BaseException) else err
    kind, state = type(orig).__name__, getattr(orig, "pgcode", None) or "none"
    if cancelled_after is not None:
        log.warning("an endpoint lookup got no answer within %g s and was cancelled (%s, "
                    "SQLSTATE %s): the database is up but the query waits (a lock, or a slow "
                    "server); such lookups get 503 busy, never a remembered answer",
                    cancelled_after, kind, state)
    else:
        log.warning("the database refused an endpoint lookup (%s, SQLSTATE %s): such "
                    "lookups get 503 busy, never a remembered answer", kind, state)
