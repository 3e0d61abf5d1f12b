"""`BaseHandler`: request ids, the JSON error envelope and typed access to the app's parts.

This is the only place where exceptions become HTTP responses. Every error the
service answers has the shape of DESIGN section 4:
``{"success": false, "error": {"code", "message", "requestId"}}``.
"""

from __future__ import annotations

import base64
import json
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

from http import HTTPStatus

from peewee import InterfaceError, OperationalError
from tornado.web import HTTPError, RequestHandler, stream_request_body

from models.db_errors import connection_lost
from service.http.errors import STATUS_CODES, BusyError, NotFoundError, ServiceError
from service.http.redaction import loggable_path

if TYPE_CHECKING:
    from service.http.context import AppContext

log = logging.getLogger("logic.http")

#: Seconds between two log lines about the same kind of refused request.
REFUSAL_LOG_INTERVAL = 10.0


class _RefusalLog:
    """One INFO line per kind of refusal (`ServiceError.log_message`) per
    interval, with how many there were: a flood of refused requests (unsigned
    chat interactions, say) must not fill the disk one line each."""

    def __init__(self, level: int = logging.INFO) -> None:
        self._level = level
        self._counts: dict[str, int] = {}
        self._logged: dict[str, float] = {}

    def __call__(self, request_id: str, code: str, message: str) -> None:
        key = f"{code}: {message}"
        count = self._counts.get(key, 0) + 1
        now = time.monotonic()
        last = self._logged.get(key)
        if last is not None and now - last < REFUSAL_LOG_INTERVAL:
            self._counts[key] = count
            return
        if len(self._logged) > 256:   # the messages are the service's own: few kinds
            self._logged.clear()
            self._counts.clear()
        self._logged[key], self._counts[key] = now, 0
        if count == 1:
            log.log(self._level, "%s %s", request_id, key)
        else:
            log.log(self._level, "%s %s (%d such since the last line about them)", request_id,
                    key, count)


_refusals = _RefusalLog()
#: Requests that failed because the database is unreachable: a WARNING per interval.
_outages = _RefusalLog(logging.WARNING)


_random = bytearray()


def new_request_id() -> str:
    """A short random id that names one request in logs, history and errors.

    12 bytes from the OS's CSPRNG, fetched 12 KiB at a time (one system call
    per thousand requests instead of one per request).
    """
    if len(_random) < 12:
        _random.extend(secrets.token_bytes(12 * 1024))
    chunk = bytes(_random[-12:])
    del _random[-12:]
    return "req_" + base64.urlsafe_b64encode(chunk).decode("ascii")


def error_body(code: str, message: str, request_id: str) -> bytes:
    """The contract's JSON error envelope (DESIGN section 4)."""
    return json.dumps({"success": False,
                       "error": {"code": code, "message": message, "requestId": request_id}},
                      separators=(",", ":")).encode()


def status_message(status: int) -> str:
    """The client message for an error status that has no error class of its own."""
    if status >= 500 and status not in (501, 505):
        return "Internal server error."
    try:
        return HTTPStatus(status).phrase + "."
    except ValueError:
        return "Error."


#: On every answer the connection makes itself, whatever the path (a dashboard
#: page's too-large form too): nothing in it may run, be framed or be cached.
CONNECTION_ERROR_HEADERS = [
    ("Content-Security-Policy", "default-src 'none'; frame-ancestors 'none'; base-uri 'none'"),
    ("X-Frame-Options", "DENY"), ("X-Content-Type-Options", "nosniff"),
    ("Cache-Control", "no-store"),
]


def render_connection_error(status: int) -> tuple[list[tuple[str, str]], bytes]:
    """Errors the HTTP connection answers itself (malformed request, head too large...)."""
    request_id = new_request_id()
    headers = [("Content-Type", "application/json"), ("X-Request-Id", request_id),
               *CONNECTION_ERROR_HEADERS]
    return (headers,
            error_body(STATUS_CODES.get(status, "bad_request"), status_message(status),
                       request_id))


class BaseHandler(RequestHandler):
    """Common behaviour of every handler of the service."""

    request_id: str
    error_code: str | None = None
    #: Headers that survive `send_error`'s reset (e.g. RateLimit-* once authenticated).
    sticky_headers: dict[str, str] = {}

    def initialize(self, context: AppContext) -> None:
        self.context = context

    def set_default_headers(self) -> None:
        # set_default_headers runs again after clear() in send_error, so the id
        # is made once and kept.
        if not hasattr(self, "request_id"):
            self.request_id = new_request_id()
        self.set_header("X-Request-Id", self.request_id)
        self.clear_header("Server")

    @classmethod
    def allowed_methods(cls) -> list[str]:
        """The methods this handler answers (what a 405's `Allow` names)."""
        return [m for m in cls.SUPPORTED_METHODS
                if getattr(cls, m.lower()) is not getattr(RequestHandler, m.lower())]

    def write_json(self, payload: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(payload, separators=(",", ":")))

    def fail(self, error: ServiceError) -> None:
        """Answer `error` now (used where raising cannot reach `write_error`)."""
        if self._finished:
            return
        self.send_error(error.status, exc_info=(type(error), error, None))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        for name, value in self.sticky_headers.items():
            self.set_header(name, value)
        if database_lost(exc):
            exc = DATABASE_BUSY if self.request.method in SAFE_METHODS else DATABASE_LOST_WRITE
            self.set_status(exc.status)
        if isinstance(exc, ServiceError):
            code, message = exc.code, exc.message
            self.error_code = code
            for name, value in exc.headers.items():
                self.set_header(name, value)
        else:
            allowed = self.allowed_methods() if (
                isinstance(exc, HTTPError) and exc.status_code == 405) else None
            if allowed:
                self.set_header("Allow", ", ".join(allowed))
            code = STATUS_CODES.get(status_code, "error")
            message = status_message(status_code)
        self.set_header("Content-Type", "application/json")
        self.finish(error_body(code, message, self.request_id))

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        if isinstance(value, ServiceError):
            # Expected outcomes of client requests: no stack trace, and only the
            # operator message (never the client's input or a secret).
            if value.log_message:
                _refusals(self.request_id, value.code, value.log_message)
            return
        if isinstance(value, HTTPError) and value.status_code < 500:
            return
        lost = lost_connection_error(value)
        if lost is not None:
            # An outage, not a fault of this request: one line per interval, the
            # error's kind only (its text names the server), no traceback.
            _outages(self.request_id, "busy", "the database is unreachable "
                     f"({type(lost).__name__}): requests that need it get 503 busy")
            return
        log.error("%s uncaught exception on %s", self.request_id,
                  loggable_path(self.request.path), exc_info=(typ, value, tb))


def lost_connection_error(exc: BaseException | None) -> BaseException | None:
    """The query error in `exc` or its chain that says the database connection
    was lost (a connection context closing a connection that is gone raises
    its own error on top), or None."""
    for _ in range(8):
        if exc is None:
            return None
        if isinstance(exc, (OperationalError, InterfaceError)) and connection_lost(exc):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def database_lost(exc: BaseException | None) -> bool:
    """Whether `exc` is, or was raised while handling, a lost database connection."""
    return lost_connection_error(exc) is not None


#: What a request that needed the database gets while it is unreachable.
DATABASE_BUSY = BusyError("The database is unreachable; retry shortly.",
                          headers={"Retry-After": "1"})
#: The same for a request that may write: the connection may have been lost
#: after the database committed it, so no retry is suggested.
DATABASE_LOST_WRITE = BusyError("The database connection was lost; the change may or may not "
                                "have been made: read the resource before trying again.")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@stream_request_body
class NotFoundHandler(BaseHandler):
    """Every path no route matches: a JSON 404 (or 405 for methods we never serve).

    It streams its body, so it is answered before any of it is read: under
    ``/api/`` the front keeps the whole of a body that brings an
    ``Authorization`` header (the admin API authenticates before it reads
    one), and a path no route matches came here holding it whole (review,
    session 25: +155 MiB from 200 connections with a made-up token)."""

    def prepare(self) -> None:
        raise NotFoundError()

    def data_received(self, chunk: bytes) -> None:
        """Never kept (the answer went out before the body)."""


__all__ = ["BaseHandler", "NotFoundHandler", "error_body", "new_request_id",
           "render_connection_error", "status_message"]
