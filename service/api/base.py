"""`APIHandler`: authentication, limits, input checks and the thread pool of `/api/v1`.

Every request, in this order, before any database work of its own:
1. throttled address (more than 20 failed authentications in 60 s, shared
   with the invoke path's wrong secrets) -> 429 `auth_throttled`;
2. `Authorization: Bearer lat_...` -> the token's identity from the
   `TokenCache` (no hash, no query), or on a miss one indexed query in the
   thread pool; unknown, revoked or expired -> 401 `unauthorized` (and one
   failure counted for the address);
3. `X-Acting-User` (operator tokens only; a user token sending it -> 403);
4. the token's own rate limit (`API_REQUESTS_PER_MINUTE`, `RateLimit-*` on
   every authenticated answer) -> 429 `rate_limited`;
5. the body within the route's cap -> 413 `payload_too_large`.

The body is read only after these (``@stream_request_body``: the connection
reads nothing of it while `prepare` runs): a caller without a valid token
never has the service hold its body, whatever header it sends (a body was
held up to the largest plan's size before the token was known: review,
session 25). A declared length over the cap is refused before a byte is read;
a streamed body past it is dropped and answered 413.

Service-layer calls are synchronous database work: `call()` runs them in a
bounded thread pool (`ApiState.executor`), never on the event loop, so a slow
statistics query cannot delay an invocation; when too many calls wait, new
ones get 503 `busy`.  Core errors become the JSON error envelope with the
core's own code and status.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from pydantic import BaseModel
from tornado.web import stream_request_body
from pydantic import ValidationError as PydanticError

from service.api.readers import ReadProcesses
from service.api.spec import operation_of
from service.core.access import Actor
from service.core.errors import CoreError
from service.core.tokencache import TokenCache
from service.core.tokens import TokenIdentity, touch_api_token
from service.http.base import BaseHandler, error_body
from service.http.event import MAX_BODY_VALUES, too_many_values
from service.http.ratelimit import AUTH_FAILURES_PER_MINUTE, LimitsUnavailable, RateLimits
from service.http.errors import (AuthThrottledError, BusyError, PayloadTooLargeError,
                                 RateLimitedError, ServiceError, UnauthorizedError)
from service.http.event import client_ip
from service.http.parsing import content_length
from service.http.fair import FairCalls
from service.http.priority import background_executor

if TYPE_CHECKING:
    from service.http.context import AppContext

log = logging.getLogger("logic.api")
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

API_REQUESTS_PER_MINUTE = 600
API_THREADS = 4
#: Calls waiting for a thread beyond this are refused (503 busy), not queued.
MAX_PENDING = 256
#: Calls of one user (or the operator, or one address's token lookups) running
#: or waiting, beyond which its next call is refused (503 busy): `service.http.fair`.
#: Above the lookups the auth throttle lets one address run at once, so a
#: client sending its good token many times at once is never refused.
PER_TENANT = 2 * AUTH_FAILURES_PER_MINUTE
DEFAULT_BODY_CAP = 64 * 1024

#: Values a call's own fields may add to the body it carries (a test call's
#: method, headers, query...): its `body` alone is held to MAX_BODY_VALUES.
BODY_FIELDS_ALLOWANCE = 256


def _too_many_values(raw: bytes | bytearray) -> bool:
    """Whether a JSON request body holds more values than a call may send."""
    try:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
    except (UnicodeDecodeError, LookupError):
        return False      # json.loads refuses it (400) without building much
    return too_many_values(text, allowance=BODY_FIELDS_ALLOWANCE)


class ApiError(ServiceError):
    """A service-layer error as the API answers it (status and code from the core)."""

    def __init__(self, status: int, code: str, message: str,
                 extra: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.code = code
        super().__init__(message, headers=headers)
        self.extra = extra or {}


class ApiState:
    """What the API handlers share: the thread pool and the token cache."""

    def __init__(self, context: AppContext) -> None:
        self.context = context
        # Below the event loop's priority, like the secret hashing threads: a
        # busy admin client takes only CPU the invoke path does not want.
        self.executor = background_executor(API_THREADS, "logic-api")
        self.tokens = TokenCache()
        self.tokens.feed = context.change_feed      # PostgreSQL: hears revocations
        url = context.settings.database.url
        # History, error log and statistics: in lower-priority processes.
        self.readers = ReadProcesses(url) if ReadProcesses.usable(url) else None
        # Shared by caller, in turns: one user's flood of slow calls never
        # holds another user's call (`service.http.fair`).
        self.calls = FairCalls(API_THREADS, MAX_PENDING, PER_TENANT)
        self.reads = FairCalls(self.readers.processes if self.readers else API_THREADS,
                               MAX_PENDING, PER_TENANT)

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any, read: bool = False,
                  **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in the thread pool, or with `read` in a reading
        process (`service.api.readers`), in `tenant`'s turn; raises `BusyError`
        when too many calls wait."""
        if read and self.readers is not None:
            readers = self.readers
            return await self.reads.run(tenant, lambda: readers.run(fn, *args, **kwargs))
        loop = asyncio.get_running_loop()
        return await self.calls.run(tenant, lambda: loop.run_in_executor(
            self.executor, lambda: fn(*args, **kwargs)))


def core_error(err: CoreError) -> ApiError:
    """The API's answer for a service-layer error."""
    extra = {k: v for k, v in err.to_dict().items() if k not in ("code", "message")}
    return ApiError(err.status, err.code, err.message, extra)


@stream_request_body
class APIHandler(BaseHandler):
    """Base of every `/api/v1` handler (see the module docstring)."""

    identity: TokenIdentity
    actor: Actor
    body_cap = DEFAULT_BODY_CAP
    public = False

    def initialize(self, context: AppContext, api: ApiState) -> None:  # type: ignore[override]
        super().initialize(context)
        self.api = api
        self.sticky_headers = {}
        self._body = bytearray()   # one buffer: an object per chunk held a 1 MiB body of
        self._received = 0         # 2-byte chunks in ~28 MiB (review, session 25)
        self._accepting = False   # set once the caller is known (end of `prepare`)

    def data_received(self, chunk: bytes) -> None:
        """A piece of the body: kept only for an authenticated caller, up to the cap."""
        self._received += len(chunk)
        if self._accepting and self._received <= self.body_cap:
            self._body += chunk

    @property
    def plans(self) -> Any:
        return self.context.settings.plans

    @property
    def base_url(self) -> str:
        return self.context.settings.server.base_url

    @property
    def ip(self) -> str:
        return client_ip(self.request.remote_ip or "", self.request.headers.get("X-Forwarded-For"),
                         self.context.settings.server.trusted_proxies)

    async def prepare(self) -> None:
        if self.public:
            return
        limits = self.context.limits
        ip = self.ip
        try:
            await self._limited(limits, ip)
        except LimitsUnavailable:
            raise BusyError("Rate limits cannot be checked right now; retry shortly.",
                            headers={"Retry-After": "1"}) from None
        # A call that takes no query parameters refuses any (after the token, like
        # every other input): `DELETE .../managers/U?dryRun=true` removed the
        # manager (review, session 27). Those that take some check them (`query`).
        op = operation_of(type(self), (self.request.method or "").lower())
        if op is not None and op.query is None and self.request.query:
            raise ApiError(400, "invalid_input", "this call takes no query parameters")

    async def _limited(self, limits: RateLimits, ip: str) -> None:
        """Authentication and the per-token limit (`prepare`).  Raises `LimitsUnavailable`."""
        wait = await limits.aauth_throttled(ip)
        if wait:
            raise AuthThrottledError("Too many failed authentications from your address; "
                                     "retry later.", headers={"Retry-After": str(wait)})
        auth = self.request.headers.get("Authorization", "")
        scheme, _, token = auth.strip().partition(" ")
        token = token.strip()
        bearer = scheme.lower() == "bearer"
        identity = self._remembered(token) if bearer and token else None
        if identity is None and token:
            # Looked up in a turn of the address's allowance: a wrong token counts
            # against it, and tokens sent all at once get no more lookups.
            wait = await limits.auth_admit(ip)
            if wait:
                raise AuthThrottledError("Too many failed authentications from your address; "
                                         "retry later.", headers={"Retry-After": str(wait)})
            failed = False
            try:
                if bearer:   # looked up meanwhile by a request it waited for: no lookup
                    identity = self._remembered(token) or await self._looked_up(token)
                failed = identity is None
            finally:
                await limits.auth_settle(ip, failed)
        if identity is None:
            raise UnauthorizedError("A valid API token is required (Authorization: Bearer lat_...).",
                                    headers={"WWW-Authenticate": "Bearer"})
        self.identity = identity
        self.actor = identity.actor
        acting = self.request.headers.get("X-Acting-User")
        if acting is not None:
            if not identity.actor.is_operator:
                raise ApiError(403, "forbidden", "only operator tokens may send X-Acting-User")
            try:
                # Every rule applies as to that user; audit records say who acted.
                self.actor = Actor.user(acting, via="operator")
            except CoreError as err:
                raise core_error(err) from None
        decision = await limits.ahit_key(f"api:{identity.token_id}", API_REQUESTS_PER_MINUTE)
        self.sticky_headers = decision.headers()
        for name, value in self.sticky_headers.items():
            self.set_header(name, value)
        if not decision.allowed:
            raise RateLimitedError("Too many admin API calls for this token; retry later.",
                                   headers={"Retry-After": str(decision.reset_seconds)})
        declared = self.request.headers.get("Content-Length")
        if declared is not None and content_length(declared) > self.body_cap:
            raise PayloadTooLargeError(f"The request body is larger than {self.body_cap} bytes.")
        self._accepting = True

    def _remembered(self, token: str) -> TokenIdentity | None:
        """The token's identity if the cache holds it (no database work)."""
        cache = self.api.tokens
        identity = cache.get(token)
        if identity is not None:
            due = cache.due_touch(token)
            if due is not None:   # lastUsedAt, at most once a minute, off the loop
                self.api.executor.submit(self._touch, due)
        return identity

    async def _looked_up(self, token: str) -> TokenIdentity | None:
        """The token's identity from the database (off the loop), then cached."""
        cache = self.api.tokens
        stamp = cache.stamp()
        identity = await self.api.run(f"address:{self.ip}", cache.lookup, token)
        if identity is not None:
            cache.put(token, identity, stamp)
        return identity

    @staticmethod
    def _touch(token_id: int) -> None:
        try:
            touch_api_token(token_id)
        except Exception:  # noqa: BLE001 - a lost lastUsedAt must not fail anything
            log.warning("could not update lastUsedAt of token %d", token_id, exc_info=True)

    # ---------------------------------------------------------------- input
    def body(self, model: type[M]) -> M:
        """The JSON body validated by `model`; raises 413 `payload_too_large` (a
        streamed body past the cap), 400 `invalid_body` / `invalid_input`."""
        if self._received > self.body_cap:
            raise PayloadTooLargeError(f"The request body is larger than {self.body_cap} bytes.")
        raw = self._body or b"null"
        # Counted before it is decoded on the event loop, as an invoke body is
        # (a test call's body under `body`, plus the call's few fields).
        if len(raw) >= 2 * MAX_BODY_VALUES and _too_many_values(raw):
            raise ApiError(400, "invalid_body", f"The request body holds more than "
                           f"{MAX_BODY_VALUES:,} JSON values.")
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            raise ApiError(400, "invalid_body", "The request body is not valid JSON.") from None
        if not isinstance(data, dict):
            raise ApiError(400, "invalid_body", "The request body must be a JSON object.")
        try:
            return model.model_validate(data)
        except PydanticError as err:
            raise ApiError(400, "invalid_input", _describe(err)) from None

    def query(self, model: type[M]) -> M:
        """The query string validated by `model`; raises 400 `invalid_input` (an
        unknown or repeated parameter too: `?dryrun=true` must not change the
        plan for real, nor `?dryRun=true&dryRun=false` mean either)."""
        for name, values in self.request.query_arguments.items():
            if len(values) > 1:
                raise ApiError(400, "invalid_input",
                               f"query parameter {name[:64]!r} is given more than once")
        raw = {name: values[-1].decode("utf-8", "replace")
               for name, values in self.request.query_arguments.items()}
        try:
            return model.model_validate(raw)
        except PydanticError as err:
            raise ApiError(400, "invalid_input", _describe(err)) from None

    # ---------------------------------------------------------------- calls
    @property
    def tenant(self) -> str:
        """Whose turn a call of this request waits for (`service.http.fair`): the
        token's user ("user:ID"), or "operator". Not the guild in the path: a
        caller could otherwise spend the turns of a guild it cannot act on."""
        return str(self.identity.actor.label)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A service-layer call in the thread pool; core errors become API errors."""
        try:
            return await self.api.run(self.tenant, fn, *args, **kwargs)
        except CoreError as err:
            raise core_error(err) from None

    async def read(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A heavy read-only service-layer call (history, errors, statistics) in a
        reading process; core errors become API errors."""
        try:
            return await self.api.run(self.tenant, fn, *args, read=True, **kwargs)
        except CoreError as err:
            raise core_error(err) from None

    def reply(self, payload: Any, status: int = 200) -> None:
        self.write_json(payload, status)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if status_code == 405 and not isinstance(exc, ServiceError):
            # A method this path does not have: say which it has.
            from service.api.spec import METHODS, operation_of
            allowed = [m.upper() for m in METHODS if operation_of(type(self), m) is not None]
            exc = ApiError(405, "method_not_allowed", f"{self.request.method} is not allowed here",
                           {}, {"Allow": ", ".join(allowed)})
            self.clear_header("Allow")
            super().write_error(405, exc_info=(ApiError, exc, None))
            return
        if isinstance(exc, ApiError) and exc.extra:
            for name, value in {**self.sticky_headers, **exc.headers}.items():
                self.set_header(name, value)
            self.error_code = exc.code
            envelope = json.loads(error_body(exc.code, exc.message, self.request_id))
            envelope["error"].update(exc.extra)
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps(envelope, separators=(",", ":")))
            return
        super().write_error(status_code, **kwargs)


def _describe(err: PydanticError) -> str:
    parts = []
    for e in err.errors()[:5]:
        where = ".".join(str(p) for p in e.get("loc", ())) or "body"
        message = str(e.get("msg", "invalid"))
        if message.startswith("Value error, "):   # our own validators' words, as they are
            message = message[len("Value error, "):]
        parts.append(f"{where}: {message}")
    return "; ".join(parts)
