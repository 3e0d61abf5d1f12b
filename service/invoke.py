"""`POST /endpoints/{guildId}/{logicScriptId}`: the public invoke endpoint.

Checks run in the order of DESIGN section 4, each failure ending the request.
Every check that needs only the headers (method, lookup, enabled, whitelist,
secret, declared length, rate limit) runs in `prepare()`, before a byte of the
body is read; the body is then streamed and reading stops at the plan's cap.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from tornado.web import stream_request_body

from sandbox.errors import PoolBusyError, PoolClosedError
from sandbox.pool import Limits, ScriptRef
from service.auth import presented_secret
from service.base import BaseHandler
from service.core.records import ErrorRecordIn, RequestRecordIn, StatHit
from service.errors import (
    OUTCOME_ERRORS,
    AuthThrottledError,
    BusyError,
    EndpointDisabledError,
    EndpointNotFoundError,
    IpNotAllowedError,
    MethodNotAllowedError,
    PayloadTooLargeError,
    RateLimitedError,
    UnauthorizedError,
)
from service.event import build_event, client_ip, ip_allowed, parse_query, visible_headers

if TYPE_CHECKING:
    from sandbox.pool import Outcome
    from service.core.invoke_target import InvokeTarget

_GUILD_ID = re.compile(r"\d{1,25}")
_SCRIPT_ID = re.compile(r"logic_[A-Za-z0-9_-]{22}")
_ALLOW = "POST, OPTIONS"


@stream_request_body
class InvokeHandler(BaseHandler):
    """Runs a script's `on endpoint` block for an authenticated POST."""

    SUPPORTED_METHODS = ("GET", "HEAD", "POST", "DELETE", "PATCH", "PUT", "OPTIONS")

    target: InvokeTarget | None = None
    accepted = False  # authenticated and counted against the quota: goes to history
    outcome: Outcome | None = None
    event: dict[str, Any] | None = None
    response_body = b""
    raw_body = b""

    def prepare(self) -> Awaitable[None] | None:
        # Synchronous unless the secret must be hashed: a cached verification
        # (the common case) costs no coroutine and no executor round trip.
        self.started = time.time()
        self.context.request_started()
        self._counted = True
        self.chunks: list[bytes] = []
        self.received = 0
        ctx = self.context
        request = self.request

        if ctx.draining:
            # Shutting down: requests still arriving on kept-alive connections
            # go elsewhere; the ones in flight finish.
            raise BusyError("The service is shutting down; retry shortly.",
                            headers={"Retry-After": "1", "Connection": "close"})

        # 1. method
        if request.method == "OPTIONS":
            self.set_status(204)
            self.set_header("Allow", _ALLOW)
            self.finish()
            return None
        if request.method != "POST":
            raise MethodNotAllowedError(headers={"Allow": _ALLOW})

        # 2. guild, script and endpoint exist
        guild_id, script_id = self.path_args
        if not _GUILD_ID.fullmatch(guild_id) or not _SCRIPT_ID.fullmatch(script_id):
            raise EndpointNotFoundError()
        target = ctx.load_target(guild_id, script_id)
        if target is None:
            raise EndpointNotFoundError()
        self.target = target

        # 3. enabled, and the plan allows endpoints
        if not target.enabled:
            raise EndpointDisabledError()

        # 4. caller IP in the whitelist
        self.ip = client_ip(request.remote_ip or "", request.headers.get("X-Forwarded-For"),
                            ctx.settings.server.trusted_proxies)
        if not ip_allowed(self.ip, target.whitelist):
            raise IpNotAllowedError()

        # 5. secret (throttled per IP before any hash is computed)
        wait = ctx.limits.auth_throttled(self.ip)
        if wait:
            raise AuthThrottledError(headers={"Retry-After": str(wait)})
        secret = presented_secret(request.headers)
        if ctx.verifier.cached(target.endpoint_id, target.secret_hash, secret):
            self._authenticated()
            return None
        return self._verify(secret)

    async def _verify(self, secret: str | None) -> None:
        target = self.target
        assert target is not None
        ctx = self.context
        if not await ctx.verifier.check(target.endpoint_id, target.secret_hash, secret):
            if secret is not None:
                ctx.limits.auth_failed(self.ip)
            raise UnauthorizedError(headers={"WWW-Authenticate": "Bearer"})
        self._authenticated()

    def _authenticated(self) -> None:
        target = self.target
        assert target is not None
        ctx = self.context
        plan = target.plan

        # 6. declared length within the plan
        declared = self.request.headers.get("Content-Length")
        if declared is not None and (not declared.isdigit() or int(declared) > plan.body_bytes):
            self._rate_headers(ctx.limits.peek_endpoint(target.endpoint_id, plan.requests_per_minute))
            raise PayloadTooLargeError()

        # 7. rate limit: authenticated requests only
        decision = ctx.limits.hit_endpoint(target.endpoint_id, plan.requests_per_minute)
        self._rate_headers(decision)
        if not decision.allowed:
            raise RateLimitedError(headers={"Retry-After": str(decision.reset_seconds)})
        self.accepted = True
        # Tornado's server-wide max_body_size (the largest plan's) stays the
        # backstop: a per-request one would answer a bare 400 before our 413.

    def _rate_headers(self, decision: Any) -> None:
        self.sticky_headers = decision.headers()
        for name, value in self.sticky_headers.items():
            self.set_header(name, value)

    def data_received(self, chunk: bytes) -> None:
        # 8. the streamed body stays within the cap (chunked bodies too)
        if self._finished:
            return
        self.received += len(chunk)
        assert self.target is not None
        if self.received > self.target.plan.body_bytes:
            self.chunks = []
            self.fail(PayloadTooLargeError())
            return
        self.chunks.append(chunk)

    async def post(self, *_args: str) -> None:
        target = self.target
        assert target is not None
        raw = b"".join(self.chunks)
        self.chunks = []
        # 9. the body parses for its content type
        self.raw_body = raw
        event = build_event(self.request, raw, self.ip, self.started)
        self.event = event
        # 10-11. a worker is free; the script runs
        limits = Limits(time_ms=target.plan.time_limit_ms, memory_kb=target.plan.memory_kb)
        ref = ScriptRef(key=target.script_id, version=target.script_version, source=target.source)
        try:
            outcome = await self.context.pool.run(ref, event, limits)
        except (PoolBusyError, PoolClosedError):
            # Closed: the service is stopping; either way, another try soon may succeed.
            raise BusyError(headers={"Retry-After": "1"}) from None
        self.outcome = outcome
        if outcome.error_kind:
            raise OUTCOME_ERRORS.get(outcome.error_kind, OUTCOME_ERRORS["script_error"])()
        self._reply(outcome)

    def _reply(self, outcome: Outcome) -> None:
        for name, value in outcome.headers:
            self.add_header(name, value)  # a name set twice is sent twice
        # X-Request-Id and RateLimit-* are already set, and no script header can
        # name them (sandbox.event.FORBIDDEN_HEADERS, checked again on arrival).
        # A script's reply must never act as a page of the origin the dashboard
        # shares: browsers treat it as a sandboxed origin with no scripts.
        self.set_header("Content-Security-Policy", "sandbox")
        self.set_header("X-Content-Type-Options", "nosniff")
        status = outcome.status
        if not 200 <= status <= 599:  # the worker promised this; never trust it blindly
            raise OUTCOME_ERRORS["invalid_reply"]()
        self.set_status(status)
        if status in (204, 304):
            # HTTP forbids a body (and its type) on these: the reply is dropped.
            self.clear_header("Content-Type")
            self.response_body = b""
            self.finish()
            return
        self.set_header("Content-Type", outcome.content_type)
        self.response_body = outcome.body
        self.finish(outcome.body)

    def finish(self, chunk: Any = None) -> Any:
        if chunk is not None and not self.response_body:
            self.response_body = chunk if isinstance(chunk, bytes) else str(chunk).encode()
        return super().finish(chunk)

    def on_finish(self) -> None:
        if getattr(self, "_counted", False):
            self._counted = False
            self.context.request_ended()
        if self.target is not None:
            self._record()

    def on_connection_close(self) -> None:
        super().on_connection_close()
        if getattr(self, "_counted", False) and not self._finished:
            self._counted = False
            self.context.request_ended()

    def _record(self) -> None:
        """Hand this request's history, error and statistics records to the writer."""
        target = self.target
        assert target is not None
        now = time.time()
        when = datetime.fromtimestamp(self.started, tz=timezone.utc)
        duration_ms = (now - self.started) * 1000.0
        status = self.get_status()
        ip = getattr(self, "ip", self.request.remote_ip or "")
        items: list[Any] = [StatHit(target.endpoint_id, when, status, duration_ms, ip)]
        outcome = self.outcome
        event = self.event
        if self.accepted:
            error = None
            if outcome is not None and outcome.error_kind:
                error = f"{outcome.error_kind}: {outcome.error_message or ''}".strip()
            elif self.error_code:
                error = self.error_code
            items.append(RequestRecordIn(
                endpoint_id=target.endpoint_id, request_id=self.request_id, time=when,
                method=self.request.method or "POST",
                query=event["query"] if event else parse_query(self.request.query),
                headers=event["headers"] if event else visible_headers(self.request.headers),
                body=self.raw_body, ip=ip,
                user_agent=self.request.headers.get("User-Agent", ""), status=status,
                response_headers=dict(self._headers.get_all()), response_body=self.response_body,
                duration_ms=duration_ms, output=outcome.output if outcome else "",
                error=error, keep=target.plan.history,
            ))
            if outcome is not None and outcome.error_kind and target.plan.error_logs:
                items.append(ErrorRecordIn(
                    endpoint_id=target.endpoint_id, request_id=self.request_id, time=when,
                    kind=outcome.error_kind, message=outcome.error_message or "",
                    line=outcome.error_line, traceback=outcome.traceback,
                ))
        self.context.records.put(*items)


routes = [(r"/endpoints/([^/]+)/([^/]+)/?", InvokeHandler)]
