"""`run_test_call`: one request through the invoke pipeline, authorised by the caller.

The reusable entry point for every front that offers a test console (the
admin API's `.../test` and `.../replay`, the dashboard's console).  The
caller has already been authorised by the service layer
(`service.core.testcalls.test_target` / `replay_request`): there is no
secret check, no enabled check and no whitelist check.  Everything after the
secret check of the invoke path (`service.http.invoke`) applies, in its order:

6/8. the body within the plan's size            -> 413 `payload_too_large`
7.   the endpoint's per-minute quota (counted once, the same window as live
     requests)                                  -> 429 `rate_limited`, `Retry-After`
9.   the body parses for its content type       -> 400 `invalid_body`
10.  a sandbox worker within the queue timeout  -> 503 `busy`, `Retry-After`
11.  the script runs.

Refusals 6-10 raise the `ServiceError` the invoke path would answer (with
the `RateLimit-*` headers in `TestCallResult.rate_headers` once counted).  A
script failure does not raise: like the invoke path, it becomes the response
an outside caller would have got (status, the error envelope), returned in
`TestCallResult.response`.  Every outcome goes to the statistics, and from
step 7 on to the history and the error log, marked `test`.

Must be called on the event loop's thread (the pool and the rate limiter
live there).  It does no database work itself: the records go through the
batched writer like the invoke path's.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from sandbox.errors import PoolBusyError, PoolClosedError
from sandbox.pool import Limits, ScriptRef
from service.core import secrets
from service.core.record_items import joined_headers
from service.core.records import ErrorRecordIn, RequestRecordIn, StatHit
from service.http.redaction import Redactor, redact_all, shaped_redactors
from service.http.base import error_body
from service.http.errors import (OUTCOME_ERRORS, BusyError, PayloadTooLargeError,
                                 RateLimitedError, ServiceError)
from service.http.event import build_event, query_for_history
from service.http.ratelimit import LimitsUnavailable
from service.http.script_run import REPLY_HEADERS, SERVICE_SET
from service.http.write_barrier import written

if TYPE_CHECKING:
    from sandbox.pool import Outcome
    from service.core.invoke_target import InvokeTarget
    from service.core.testcalls import TestRequest
    from service.http.context import AppContext


@dataclass
class TestCallResult:
    """What the invoke path would have answered, and the quota state."""

    request_id: str
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    duration_ms: float
    output: str = ""
    error_code: str | None = None
    replay_of: str | None = None
    rate_headers: dict[str, str] = field(default_factory=dict)

    def response(self) -> dict[str, Any]:
        """The JSON shape the API answers (`TestCallResult` in the OpenAPI document)."""
        try:
            text, encoding = self.body.decode("utf-8"), "text"
        except UnicodeDecodeError:
            text, encoding = base64.b64encode(self.body).decode("ascii"), "base64"
        return {"requestId": self.request_id, "test": True, "replayOf": self.replay_of,
                "status": self.status, "headers": _joined(self.headers),
                "body": text, "bodyEncoding": encoding, "durationMs": round(self.duration_ms, 3),
                "output": self.output, "error": self.error_code}


def _joined(headers: list[tuple[str, str]]) -> dict[str, str]:
    """The answer's headers as one object: a name sent twice (a script's two
    `Vary` lines) once, its values joined by ", " (RFC 9110 5.3), under the
    spelling it was first sent with."""
    out: dict[str, str] = {}
    spelled: dict[str, str] = {}
    for name, value in headers:
        key = spelled.setdefault(name.lower(), name)
        out[key] = f"{out[key]}, {value}" if key in out else value
    return out


async def run_test_call(context: AppContext, target: InvokeTarget, request: TestRequest, *,
                        ip: str, request_id: str) -> TestCallResult:
    """Run `request` on `target` (see the module docstring).  Raises
    `PayloadTooLargeError`, `RateLimitedError`, `InvalidBodyError`, `BusyError`."""
    started = time.time()
    plan = target.plan
    run = _Run(context, target, request, ip, request_id, started)
    try:
        if len(request.body) > plan.body_bytes:
            raise PayloadTooLargeError()
        try:
            decision = await context.limits.ahit_endpoint(target.endpoint_id,
                                                          plan.requests_per_minute)
        except LimitsUnavailable:
            raise BusyError("Rate limits cannot be checked right now; retry shortly.",
                            headers={"Retry-After": "1"}) from None
        run.rate_headers = decision.headers()
        if not decision.allowed:
            raise RateLimitedError(headers={"Retry-After": str(decision.reset_seconds)})
        run.accepted = True
        event = build_event(request.method, request.query, request.headers, request.body, ip,
                            started)
        limits = Limits(time_ms=plan.time_limit_ms, memory_kb=plan.memory_kb)
        ref = ScriptRef(key=target.script_id, version=target.script_version, source=target.source)
        try:
            future = context.pool.submit(ref, event, limits, target.guild_id)
            outcome = await asyncio.shield(future)
        except (PoolBusyError, PoolClosedError):
            raise BusyError(headers={"Retry-After": "1"}) from None
        run.outcome = outcome
        result = run.finish(*_reply(outcome, request_id))
    except ServiceError as err:
        run.finish(err.status, [("Content-Type", "application/json")],
                   error_body(err.code, err.message, request_id), err.code)
        await written(context.records)
        raise
    # Answered once its records are in the database: the caller's next step
    # is often to read or replay the request, maybe through another front.
    await written(context.records)
    return result


def _reply(outcome: Outcome, request_id: str) -> tuple[int, list[tuple[str, str]], bytes, str | None]:
    """The invoke path's answer for `outcome`: (status, headers, body, error code)."""
    if outcome.error_kind or not 200 <= outcome.status <= 599:
        kind = outcome.error_kind or "invalid_reply"
        err = OUTCOME_ERRORS.get(kind, OUTCOME_ERRORS["script_error"])()
        return (err.status, [("Content-Type", "application/json")],
                error_body(err.code, err.message, request_id), err.code)
    headers = [pair for pair in outcome.headers if pair[0].lower() not in SERVICE_SET]
    headers += REPLY_HEADERS
    if outcome.status in (204, 205, 304):   # no content, as the invoke path sends them
        return outcome.status, headers, b"", None
    headers.append(("Content-Type", outcome.content_type))
    return outcome.status, headers, outcome.body, None


class _Run:
    """The state of one test call, turned into records once it is answered."""

    def __init__(self, context: AppContext, target: InvokeTarget, request: TestRequest, ip: str,
                 request_id: str, started: float) -> None:
        self.context, self.target, self.request = context, target, request
        self.ip, self.request_id, self.started = ip, request_id, started
        self.accepted = False
        self.outcome: Outcome | None = None
        self.rate_headers: dict[str, str] = {}

    def finish(self, status: int, headers: list[tuple[str, str]], body: bytes,
               error_code: str | None) -> TestCallResult:
        duration_ms = (time.time() - self.started) * 1000.0
        result = TestCallResult(self.request_id, status, headers, body, duration_ms,
                                self.outcome.output if self.outcome else "", error_code,
                                self.request.replay_of, self.rate_headers)
        for item in self._records(result):
            self.context.records.put(item)
        return result

    def _records(self, result: TestCallResult) -> list[Any]:
        target, request, outcome = self.target, self.request, self.outcome
        when = datetime.fromtimestamp(self.started, tz=timezone.utc)
        items: list[Any] = [StatHit(target.endpoint_id, when, result.status, result.duration_ms,
                                    self.ip, test=True)]
        if not self.accepted:
            return items
        error = None
        if outcome is not None and outcome.error_kind:
            error = f"{outcome.error_kind}: {outcome.error_message or ''}".strip()
        elif result.error_code:
            error = result.error_code
        query = query_for_history(request.query)
        message = (outcome.error_message or "") if outcome is not None else ""
        traceback = outcome.traceback if outcome is not None else None
        # A test call presents no secret: any secret or token it carries (the
        # endpoint's own, pasted into a body; `redaction.SHAPES`) is redacted by
        # its shape, and the endpoint's own random part standing alone by its
        # keyed verifier.
        secret_hash = target.secret_hash
        shaped = shaped_redactors(
            query, request.headers, request.body, result.body, result.output, error,
            traceback, is_secret=(functools.partial(secrets.verify_fast, secret_hash)
                                  if secret_hash and secrets.is_fast(secret_hash) else None))

        by_name = Redactor(None)   # credential-named parameters, as for an invocation

        def clean(value: Any) -> Any:
            if isinstance(value, dict):
                value = by_name.mapping(value)
            return redact_all(shaped, value) if shaped and value else value
        items.append(RequestRecordIn(
            endpoint_id=target.endpoint_id, request_id=self.request_id, time=when,
            method=request.method, query=clean(query), headers=clean(request.headers),
            body=clean(request.body), ip=self.ip,
            user_agent=clean(request.headers.get("user-agent", "")), status=result.status,
            response_headers=clean(joined_headers(result.headers)),
            response_body=clean(result.body),
            duration_ms=result.duration_ms, output=clean(result.output), error=clean(error),
            keep=target.plan.history, test=True, script_version=target.script_version))
        if outcome is not None and outcome.error_kind and target.plan.error_logs:
            items.append(ErrorRecordIn(
                endpoint_id=target.endpoint_id, request_id=self.request_id, time=when,
                kind=outcome.error_kind, message=clean(message),
                line=outcome.error_line, traceback=clean(traceback),
                script_version=target.script_version))
        return items
