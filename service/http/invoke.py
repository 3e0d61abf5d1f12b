"""`POST /endpoints/{guildId}/{logicScriptId}`: the public invoke endpoint.

Checks run in the order of DESIGN section 4, each failure ending the request.
Every check that needs only the headers (method, lookup, enabled, whitelist,
secret, declared length, rate limit) runs in `headers_received()`, before a
byte of the body is read; the body is then streamed through `data_received()`
and reading stops at the plan's cap; `finish()` hands the event to the pool
(`service.http.script_run`); `service.http.invoke_answer` sends the answer and
queues the request's records.

This is a streaming Tornado `HTTPMessageDelegate` — the interface
`@stream_request_body` handlers are built on — rather than a `RequestHandler`:
the invoke path is the service's hot path, and `Application` routing plus
`RequestHandler`'s per-request set-up cost about 75 µs of the ~225 µs a request
may take (docs/performance.md). The HTTP connection (`service.http.connection`) sends
every request under ``/endpoints/`` here; every other path goes to the Tornado
`Application`.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar, cast

from tornado import httputil

from service.http.auth import Throttled, VerifierBusy, counted_check, presented_secret
from service.http.base import new_request_id
from service.http.errors import (
    AuthThrottledError,
    BusyError,
    EndpointDisabledError,
    EndpointNotFoundError,
    IpNotAllowedError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitedError,
    ServiceError,
    UnauthorizedError,
)
from service.http.event import client_ip, ip_allowed
from service.core.invoke_target import InvokeTarget, NeedsQuery, TargetsUnavailable
from service.http.memory_windows import Stamp
from service.http.ratelimit import LimitsUnavailable
from service.http.invoke_answer import RequestAnswers
from service.http.parsing import content_length
from service.http.script_run import ScriptRun

if TYPE_CHECKING:
    import asyncio

    from sandbox.pool import Outcome
    from service.http.context import AppContext
    from service.http.exchange import Exchange

_T = TypeVar("_T")

PREFIX = "/endpoints/"
#: The one form of an endpoint's path: no trailing slash, no percent-encoding
#: (anything else is 404, so history, statistics and limits see one form).
_ROUTE = re.compile(r"/endpoints/([^/]+)/([^/]+)")
_GUILD_ID = re.compile(r"[0-9]{1,25}")
_SCRIPT_ID = re.compile(r"logic_[A-Za-z0-9_-]{22}")
#: What the invoke path answers (its 405's and OPTIONS' `Allow`).
INVOKE_METHODS = ("POST", "OPTIONS")
_ALLOW = ", ".join(INVOKE_METHODS)


class InvokeEndpoint(httputil.HTTPServerConnectionDelegate):
    """Starts one `InvokeRequest` per request; the HTTP connection routes ``/endpoints/`` here."""

    #: Headers as a dict with lower-case names (service.http.connection), not HTTPHeaders.
    plain_headers = True

    def __init__(self, context: AppContext) -> None:
        self.context = context

    def start_request(self, server_conn: object,
                      request_conn: httputil.HTTPConnection) -> InvokeRequest:
        return InvokeRequest(self.context, cast("Exchange", request_conn))


def _answered(step: Callable[..., Coroutine[Any, Any, None]]
              ) -> Callable[..., Coroutine[Any, Any, None]]:
    """An asynchronous step of `InvokeRequest` whose failure is answered as
    `InvokeRequest._guarded` answers a synchronous one's."""
    @functools.wraps(step)
    async def answered(self: InvokeRequest, *args: Any) -> None:
        try:
            await step(self, *args)
            if self.answered:
                # The client left while this step waited (a secret's check, a
                # Redis call): the slot its rate limit took meanwhile is free.
                self._give_back_quota()
        except Exception as exc:  # noqa: BLE001 - one request's bug must not reach the connection
            self._failed(exc)
    return answered


class InvokeRequest(ScriptRun, RequestAnswers, httputil.HTTPMessageDelegate):
    """One invoke request, from its headers to its records."""

    __slots__ = ("context", "conn", "peer", "request_id", "started", "method", "path", "query",
                 "headers", "ip", "target", "accepted", "quota_stamp", "chunks", "received", "rate_headers", "answered", "status",
                 "response_headers", "response_body", "error_code", "outcome", "event",
                 "raw_body", "finished", "_counted", "pending", "waited", "parse_s")

    def __init__(self, context: AppContext, conn: Exchange) -> None:
        self.context = context
        self.conn: Exchange | None = conn
        self.peer: str = conn.context.remote_ip
        self.request_id = new_request_id()
        self.started = 0.0
        self.method = ""
        self.path = ""
        self.query = ""
        self.headers: dict[str, str] = {}
        self.ip = ""
        self.target: InvokeTarget | None = None
        self.accepted = False  # authenticated and counted against the quota: goes to history
        self.quota_stamp: Stamp = None
        self.chunks: list[bytes | bytearray] = []  # the body: one part, or one buffer
        self.received = 0
        self.rate_headers: list[tuple[str, str]] = []
        self.answered = False
        self.status = 0
        self.response_headers: list[tuple[str, str]] = []
        self.response_body = b""
        self.error_code: str | None = None
        self.outcome: Outcome | None = None
        self.event: dict[str, Any] | None = None
        self.raw_body = b""
        self.finished = 0.0
        self._counted = False
        self.pending: asyncio.Future[Outcome] | None = None
        self.waited = False  # waited in the pool's queue, then refused busy or withdrawn

    # --- header phase: checks 1-7 ----------------------------------------------
    def headers_received(self, start_line: httputil.RequestStartLine | httputil.ResponseStartLine,
                         headers: dict[str, str]  # type: ignore[override]
                         ) -> Awaitable[None] | None:
        assert isinstance(start_line, httputil.RequestStartLine)
        self.started = time.time()
        self.context.request_started()
        self._counted = True
        self.headers = headers
        return self._guarded(lambda: self._check(start_line, headers))

    def _guarded(self, step: Callable[[], _T]) -> _T | None:
        """Run `step`; its failure is answered (`_failed`)."""
        try:
            return step()
        except Exception as exc:  # noqa: BLE001 - one request's bug must not reach the connection
            self._failed(exc)
        return None

    def _failed(self, exc: Exception) -> None:
        """Answer a failed step (call in its `except`): a ServiceError as itself, an
        unreachable database or rate-limit storage 503 `busy`, anything else 500."""
        if isinstance(exc, ServiceError):
            self._fail(exc)
        elif isinstance(exc, TargetsUnavailable):
            self._fail(_database_down())
        elif isinstance(exc, LimitsUnavailable):
            self._fail(_limits_down())
        else:
            self._internal_error()

    def _check(self, start_line: httputil.RequestStartLine,
               headers: dict[str, str]) -> Awaitable[None] | None:
        ctx = self.context
        self.method = method = start_line.method
        path, _, self.query = start_line.path.partition("?")
        self.path = path
        if ctx.draining:
            # Shutting down: requests still arriving on kept-alive connections
            # go elsewhere; the ones in flight finish.  A trusted proxy's
            # request (its headers were on the way when the drain began) is
            # dropped unanswered: nothing ran, and the proxy sends a request
            # that finds its connection closed to another node.
            conn = self.conn
            if conn is not None and conn.conn.server.trusted_proxy(self.peer):
                self.answered = True
                self.conn = None
                self._ended()
                conn.conn.close_now()
                return None
            raise BusyError("The service is shutting down; retry shortly.",
                            headers={"Retry-After": "1", "Connection": "close"})
        route = _ROUTE.fullmatch(path)
        if route is None:
            raise NotFoundError()

        # 1. method
        if method == "OPTIONS":
            self._answer(204, [("Allow", _ALLOW), ("X-Request-Id", self.request_id)], b"")
            return None
        if method != "POST":
            raise MethodNotAllowedError(headers={"Allow": _ALLOW})

        # 2. guild, script and endpoint exist
        guild_id, script_id = route.groups()
        if not _GUILD_ID.fullmatch(guild_id) or not _SCRIPT_ID.fullmatch(script_id):
            raise EndpointNotFoundError()
        self.ip = client_ip(self.peer, headers.get("x-forwarded-for"),
                            ctx.settings.server.trusted_proxies)
        if ctx.limits.remote:
            return self._shared(guild_id, script_id)
        # Known now, acted on at check 5: an address that is throttled for
        # wrong secrets is answered from a lookup at most a second old, so a
        # flood of them costs no database read each (docs/http-api.md).
        return self._checks(ctx.limits.auth_throttled(self.ip), guild_id, script_id)

    def _checks(self, wait: int, guild_id: str, script_id: str) -> Awaitable[None] | None:
        """Checks 2-7; `wait`: seconds the caller's address is throttled for wrong secrets."""
        ctx = self.context
        found = ctx.load_target.lookup(guild_id, script_id)
        if isinstance(found, NeedsQuery):  # PostgreSQL: the query runs off the loop
            if wait:
                # A throttled address: a lookup at most a second old will do
                # to refuse it, never to let it in (a secret regenerated or an
                # endpoint disabled within that second): a request it would
                # admit is looked up afresh.
                known, target = ctx.recent_targets.get(guild_id, script_id)
                if known and not self._admits(target):
                    return self._checked(wait, target)
            return self._fetched(wait, guild_id, script_id)
        return self._checked(wait, found)

    @_answered
    async def _fetched(self, wait: int, guild_id: str, script_id: str) -> None:
        target = await self.context.load_target.fetch(guild_id, script_id)
        if wait:
            self.context.recent_targets.put(guild_id, script_id, target)
        step = self._checked(wait, target)
        if step is not None:
            await step

    def _admits(self, target: InvokeTarget | None) -> bool:
        """Whether checks 2-5 pass on `target` without a hash (a secret verified before)."""
        return (target is not None and target.enabled and ip_allowed(self.ip, target.whitelist)
                and self.context.verifier.cached(target.endpoint_id, target.secret_hash,
                                                 presented_secret(self.headers)))

    def _checked(self, wait: int, target: InvokeTarget | None) -> Awaitable[None] | None:
        """Checks 2 (the answer of the lookup) to 7."""
        ctx = self.context
        if target is None:
            raise EndpointNotFoundError()
        self.target = target

        # 3. enabled, and the plan allows endpoints
        if not target.enabled:
            raise EndpointDisabledError()

        # 4. caller IP in the whitelist
        if not ip_allowed(self.ip, target.whitelist):
            raise IpNotAllowedError()

        # 5. secret (throttled per IP before any hash is computed; a secret
        # already verified costs no hash, so it is answered even then: a
        # client sharing an address with an attacker is not locked out)
        secret = presented_secret(self.headers)
        if ctx.verifier.cached(target.endpoint_id, target.secret_hash, secret):
            return self._authenticated()
        if wait:
            raise AuthThrottledError(headers={"Retry-After": str(wait)})
        return self._verify(secret)  # argon2 (legacy hashes) off the loop; reading waits

    @_answered
    async def _shared(self, guild_id: str, script_id: str) -> None:
        """Checks 2-7 when the limits live in Redis: the same, their Redis calls awaited
        (reading the body waits meanwhile; the loop serves everything else).

        A request whose endpoint is remembered and whose secret already
        verified needs no throttle check (it is answered even from a throttled
        address): one Redis call, the rate limit's, instead of two."""
        ctx = self.context
        found = ctx.load_target.lookup(guild_id, script_id)
        if (isinstance(found, InvokeTarget) and found.enabled
                and ip_allowed(self.ip, found.whitelist)
                and ctx.verifier.cached(found.endpoint_id, found.secret_hash,
                                        presented_secret(self.headers))):
            self.target = found
            await self._admit_shared(found)
            return
        step = self._checks(await ctx.limits.aauth_throttled(self.ip), guild_id, script_id)
        if step is not None:
            await step

    @_answered
    async def _verify(self, secret: str | None) -> None:
        target = self.target
        assert target is not None
        ctx = self.context
        try:
            ok = await counted_check(ctx.verifier, ctx.limits, self.ip, target.endpoint_id,
                                     target.secret_hash, secret)
        except Throttled as throttled:
            raise AuthThrottledError(headers={"Retry-After": str(throttled.wait)}) from None
        except VerifierBusy:
            raise BusyError("Too many secrets are being checked; retry shortly.",
                            headers={"Retry-After": "1"}) from None
        if not ok:
            raise UnauthorizedError(headers={"WWW-Authenticate": "Bearer"})
        step = self._authenticated()
        if step is not None:
            await step

    def _authenticated(self) -> Awaitable[None] | None:
        target = self.target
        assert target is not None
        limits = self.context.limits
        if limits.remote:
            return self._admit_shared(target)
        plan = target.plan

        # 6. declared length within the plan
        if self._too_long(plan.body_bytes):
            self.rate_headers = list(
                limits.peek_endpoint(target.endpoint_id, plan.requests_per_minute).headers().items())
            raise PayloadTooLargeError()

        # 7. rate limit: authenticated requests only
        decision = limits.hit_endpoint(target.endpoint_id, plan.requests_per_minute)
        self.rate_headers = list(decision.headers().items())
        if not decision.allowed:
            raise RateLimitedError(headers={"Retry-After": str(decision.reset_seconds)})
        self.accepted, self.quota_stamp = True, decision.stamp
        return None

    async def _admit_shared(self, target: InvokeTarget) -> None:
        """Checks 6 and 7 with the windows in Redis.  Raises `LimitsUnavailable`."""
        limits = self.context.limits
        plan = target.plan
        if self._too_long(plan.body_bytes):
            decision = await limits.apeek_endpoint(target.endpoint_id, plan.requests_per_minute)
            self.rate_headers = list(decision.headers().items())
            raise PayloadTooLargeError()
        decision = await limits.ahit_endpoint(target.endpoint_id, plan.requests_per_minute)
        self.rate_headers = list(decision.headers().items())
        if not decision.allowed:
            raise RateLimitedError(headers={"Retry-After": str(decision.reset_seconds)})
        self.accepted, self.quota_stamp = True, decision.stamp

    def _too_long(self, cap: int) -> bool:
        declared = self.headers.get("content-length")
        return declared is not None and (not (declared.isascii() and declared.isdigit())
                                         or content_length(declared) > cap)

    # --- body: check 8 --------------------------------------------------------------
    def data_received(self, chunk: bytes) -> None:
        if self.answered:
            return
        self.received += len(chunk)
        assert self.target is not None
        if self.received > self.target.plan.body_bytes:
            self.chunks = []
            self._fail(PayloadTooLargeError())  # the connection stops reading and closes
            return
        chunks = self.chunks
        if not chunks:
            chunks.append(chunk)    # one part (the usual case): joined without a copy
            return
        # More parts go into one buffer: an object per part held a 1 MB body
        # sent as 2-byte chunks in ~18 MB.
        first = chunks[0]
        if type(first) is bytes:
            first = chunks[0] = bytearray(first)
        first += chunk

    # --- the request is complete: checks 9-11 ------------------------------------------
    def finish(self) -> None:
        if not self.answered:
            self._guarded(self._submit)

    def on_connection_close(self) -> None:
        # The client went away before its request was complete (its body never
        # came whole): no script ran, so an authenticated request gives its
        # quota slot back, as a 503 busy does; it took slots with nothing in
        # history to explain the 429s that followed (review, session 25).
        if not self.answered:
            self._give_back_quota()
        super().on_connection_close()


def _limits_down() -> BusyError:
    """`ratelimit.on_storage_error = "closed"` while the shared storage is unreachable."""
    return BusyError("Rate limits cannot be checked right now; retry shortly.",
                     headers={"Retry-After": "1"})


def _database_down() -> BusyError:
    """PostgreSQL is unreachable and this endpoint's answer is not remembered."""
    return BusyError("The endpoint cannot be looked up right now; retry shortly.",
                     headers={"Retry-After": "1"})
