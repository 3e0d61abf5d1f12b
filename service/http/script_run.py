"""`ScriptRun`: an invoke request's round trip through the sandbox pool.

Checks 9-11 of the invoke path once the body is complete: build the event,
submit it with the guild (the pool's fair queue decides when it runs), take a
request whose client left out of the queue, and turn the outcome into the
reply (script headers filtered, the service's own headers added) or a 503
`busy` that gives the quota slot back. A mixin of
`service.http.invoke.InvokeRequest`, which holds the state.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from sandbox.errors import PoolBusyError, PoolClosedError
from sandbox.pool import Limits, ScriptRef
from service.http.errors import OUTCOME_ERRORS, BusyError
from service.http.event import HINT_HEADER, body_hint, build_event
from service.http.parse_ledger import HELD_BYTES

if TYPE_CHECKING:
    import asyncio

    from sandbox.pool import Outcome
    from service.core.invoke_target import InvokeTarget
    from service.http.context import AppContext
    from service.http.exchange import Exchange
    from service.http.memory_windows import Stamp

_T = TypeVar("_T")

#: On every script reply: browsers treat it as a sandboxed origin with no
#: scripts (it must never act as a page of the origin the dashboard shares).
REPLY_HEADERS = [("Content-Security-Policy", "sandbox"), ("X-Content-Type-Options", "nosniff")]
#: Set by the service on every reply; a script's own value for them is dropped.
SERVICE_SET = frozenset({"content-security-policy", "x-content-type-options", "content-type"})


class ScriptRun:
    """The sandbox half of `InvokeRequest` (which initialises these)."""

    context: AppContext
    conn: Exchange | None
    target: InvokeTarget | None
    chunks: list[bytes | bytearray]
    raw_body: bytes
    event: dict[str, Any] | None
    method: str
    query: str
    headers: dict[str, str]
    ip: str
    started: float
    request_id: str
    accepted: bool
    #: The request's own hit in its endpoint's window (`Decision.stamp`), given back on 503 busy.
    quota_stamp: Stamp
    rate_headers: list[tuple[str, str]]
    pending: asyncio.Future[Outcome] | None
    waited: bool
    #: Seconds its body took to decode (set before it can be refused busy).
    parse_s: float
    outcome: Outcome | None

    if TYPE_CHECKING:  # provided by InvokeRequest
        def _guarded(self, step: Callable[[], _T]) -> _T | None: ...

        def _answer(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None: ...

    def _submit(self) -> None:
        target = self.target
        assert target is not None
        raw = b"".join(self.chunks)
        self.chunks = []
        self.raw_body = raw
        large = len(raw) >= HELD_BYTES
        held = self.context.held_bodies
        if large and not held.take(target.guild_id):
            # Its guild keeps as many large bodies decoded as it may: refused
            # before this one is (nothing decoded, nothing to charge).
            self.parse_s = 0.0
            raise self._busy()
        try:
            # 9. the body parses for its content type (timed: a 503 that gives
            # the quota slot back charges it to the guild's parse_ledger)
            t0 = time.perf_counter()
            self.event = event = build_event(self.method, self.query, self.headers, raw,
                                             self.ip, self.started)
            self.parse_s = time.perf_counter() - t0
            # 10-11. a worker is free; the script runs
            limits = Limits(time_ms=target.plan.time_limit_ms, memory_kb=target.plan.memory_kb)
            ref = ScriptRef(key=target.script_id, version=target.script_version,
                            source=target.source)
            try:
                future = self.context.pool.submit(ref, event, limits, target.guild_id)
            except (PoolBusyError, PoolClosedError):
                # Closed: the service is stopping; either way, another try soon may succeed.
                raise self._busy() from None
        except BaseException:
            if large:
                held.release(target.guild_id)
            raise
        if large:   # held until its outcome (the pool settles every future)
            guild = target.guild_id
            future.add_done_callback(lambda _: held.release(guild))
        if not future.done():
            # The client leaving takes a queued request out of the pool's queue at once.
            self.pending = future
            conn = self.conn
            if conn is not None:
                conn.set_close_callback(self._client_left)
                conn.eof_callback = self._client_left
        future.add_done_callback(self._on_outcome)

    def _client_left(self) -> None:
        """The connection closed while the request waited for (or ran in) a worker.

        A request still in the pool's queue leaves it at once (recorded as 503
        busy: no script ran); one already running finishes and is answered as
        usual. Its quota slot stays used: its body was parsed and it was
        queued, and a client that sends and leaves must not get that work done
        past its rate limit again and again (review, session 28)."""
        future, self.pending = self.pending, None
        if future is not None:
            self.quota_stamp = None   # nothing to give back: the slot stays used
            self.context.pool.withdraw(future)

    def _busy(self) -> BusyError:
        """503 busy: no script ran, so the request gives its quota slot back
        (unless its client left: `_client_left`; or the decoding of its guild's
        refunded bodies is past what `parse_ledger` gives back)."""
        target = self.target   # set: a request is refused busy only after its body parsed
        if target is not None and self.context.parse_ledger.refund(target.guild_id,
                                                                    self.parse_s):
            self._give_back_quota()
        return BusyError(headers={"Retry-After": "1"})

    def _give_back_quota(self) -> None:
        """No script ran for this authenticated request: its quota slot is free
        again (and the rate-limit headers say so)."""
        target = self.target
        if target is not None and self.accepted and self.quota_stamp is not None:
            stamp, self.quota_stamp = self.quota_stamp, None   # given back once
            limits = self.context.limits
            per_minute = target.plan.requests_per_minute
            if limits.remote:
                # Redis: given back in the background; the headers count the slot as free.
                self.context.background(limits.arefund_endpoint(target.endpoint_id, per_minute,
                                                                  stamp))
                headers = dict(self.rate_headers)
                remaining = min(per_minute, int(headers.get("RateLimit-Remaining", "0")) + 1)
                headers["RateLimit-Remaining"] = str(remaining)
                if remaining == per_minute:
                    headers["RateLimit-Reset"] = "0"   # the slot given back was the only one
                self.rate_headers = list(headers.items())
            else:
                limits.refund_endpoint(target.endpoint_id, per_minute, stamp)
                self.rate_headers = list(limits.peek_endpoint(
                    target.endpoint_id, per_minute).headers().items())

    def _on_outcome(self, future: asyncio.Future[Outcome]) -> None:
        self._guarded(lambda: self._reply(self._outcome_of(future)))

    def _outcome_of(self, future: asyncio.Future[Outcome]) -> Outcome:
        self.pending = None
        if future.cancelled():
            self.waited = True
            raise self._busy()
        error = future.exception()
        if isinstance(error, (PoolBusyError, PoolClosedError)):
            self.waited = True
            raise self._busy()
        if error is not None:
            raise error
        self.outcome = outcome = future.result()
        if outcome.error_kind:
            raise OUTCOME_ERRORS.get(outcome.error_kind, OUTCOME_ERRORS["script_error"])()
        return outcome

    def _reply(self, outcome: Outcome) -> None:
        status = outcome.status
        if not 200 <= status <= 599:  # the worker promised this; never trust it blindly
            raise OUTCOME_ERRORS["invalid_reply"]()
        # A name the script set twice is sent twice. No script header can name
        # X-Request-Id, RateLimit-* or the framing headers
        # (sandbox.event.FORBIDDEN_HEADERS, checked again on arrival).
        headers = [pair for pair in outcome.headers if pair[0].lower() not in SERVICE_SET]
        headers += [("X-Request-Id", self.request_id), *self.rate_headers, *REPLY_HEADERS]
        hint = body_hint(self.headers.get("content-type", ""), self.raw_body)
        if hint is not None:
            headers.append((HINT_HEADER, hint))
        if status in (204, 205, 304):
            # HTTP forbids a body (and its type) on these: the reply is dropped.
            self._answer(status, headers, b"")
            return
        headers.append(("Content-Type", outcome.content_type))
        self._answer(status, headers, outcome.body)
