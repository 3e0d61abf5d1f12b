"""`DashboardHandler`: sessions, XSRF, security headers and HTML errors for every page.

- The session cookie `logic_session` holds a random token signed with
  `server.cookie_secret` (Tornado's signed value), `HttpOnly`,
  `SameSite=Lax`, `Secure` when `server.base_url` is https; the database keeps
  only its hash (`service.core.sessions`).
- Every state-changing request (any method but GET/HEAD) must carry the
  session's XSRF token, in the form field `_xsrf` or the `X-XSRF-Token`
  header; the token is an HMAC of the session token, so it is bound to it.
- Every answer carries a strict Content-Security-Policy (scripts and styles
  only from the dashboard's own static files, nothing inline, no frames),
  `X-Frame-Options: DENY`, `Referrer-Policy: no-referrer` (a login link
  never leaks through a Referer), and, except a static file served,
  `Cache-Control: no-store` (so the back button after logout shows nothing
  private); so do the 404s of paths under `/dashboard` that no route
  matches.
- Service-layer calls run in a small thread pool (they do database I/O).
"""
from __future__ import annotations

import hashlib
import html
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, Callable, TypeVar
from urllib.parse import urlparse

from tornado.httputil import parse_cookie
from tornado.ioloop import IOLoop
from tornado.web import HTTPError, create_signed_value, decode_signed_value

from service.core.errors import CoreError, NotFoundError, PermissionDeniedError
from service.core.sessions import Session, check_xsrf, resume, xsrf_token
from service.http.base import BaseHandler, database_lost
from service.http.errors import BusyError
from service.http.fair import FairCalls
from service.http.priority import background_executor
from service.settings import Settings

log = logging.getLogger("logic.dashboard")

HERE = Path(__file__).resolve().parent
TEMPLATES = str(HERE / "templates")
COOKIE = "logic_session"
SAFE_METHODS = ("GET", "HEAD")

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}

T = TypeVar("T")


#: Threads for the dashboard's service-layer calls, shared by user in turns
#: (`service.http.fair`: one user never holds both while another waits).
DASHBOARD_THREADS = 2
#: Calls running or waiting, per user and in all (calls before a session is
#: known, resuming it or logging in, are not counted: they have no user yet).
PER_TENANT, MAX_PENDING = 16, 256


def session_token(raw: str | None, settings: Settings) -> str:
    """The session token a session cookie's value carries, "" unless this
    service signed it (and it is not older than a session may be)."""
    if not raw:
        return ""
    max_days = settings.dashboard.session_max_hours / 24
    # Version 2 only: Tornado logs a version-1 cookie whose signature fails,
    # whole, at WARNING (a header value in the log, per request).
    value = decode_signed_value(settings.server.cookie_secret, COOKIE, raw,
                                max_age_days=max_days, min_version=2)
    return value.decode("ascii", "replace") if value else ""


def signed_session_in(cookie_header: str, settings: Settings) -> bool:
    """Whether a request's `Cookie` header holds a session cookie this service
    signed (service.http.app: how much of a body the front keeps)."""
    if COOKIE not in cookie_header:
        return False
    return bool(session_token(parse_cookie(cookie_header).get(COOKIE), settings))


@dataclass
class Dashboard:
    """What every dashboard handler shares: settings and the service-layer thread pool."""

    settings: Settings
    # Below the loop's priority, like the API's: a save's compile process
    # inherits it (service.http.priority).
    executor: ThreadPoolExecutor = field(default_factory=lambda: background_executor(
        DASHBOARD_THREADS, "logic-dashboard"))
    calls: FairCalls = field(default_factory=lambda: FairCalls(
        DASHBOARD_THREADS, MAX_PENDING, PER_TENANT, name="dashboard"))

    @property
    def secure_cookies(self) -> bool:
        return urlparse(self.settings.server.base_url).scheme == "https"

    @property
    def idle(self) -> timedelta:
        return timedelta(minutes=self.settings.dashboard.session_idle_minutes)

    @property
    def absolute(self) -> timedelta:
        return timedelta(hours=self.settings.dashboard.session_max_hours)


class PageError(HTTPError):
    """An error page with a status and a message safe to show."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(status)
        self.status, self.message, self.headers = status, message, headers or {}


def static_url(name: str) -> str:
    """The URL of a file under `static/`, with its modification time to bust caches."""
    try:
        version = int((HERE / "static" / name).stat().st_mtime)
    except OSError:
        version = 0
    return f"/dashboard/static/{name}?v={version}"


def time_html(value: str | None) -> str:
    """A `<time>` the page's script shows in the viewer's time zone (UTC without script)."""
    if not value:
        return "—"
    text = html.escape(value)
    shown = html.escape(value.replace("T", " ").replace("Z", "")[:19] + " UTC")
    return f'<time datetime="{text}">{shown}</time>'


class DashboardHandler(BaseHandler):
    """Base of every dashboard page: needs a live session unless `public`."""

    public = False
    session: Session | None = None
    session_token: str = ""

    def initialize(self, context: Any, dashboard: Dashboard) -> None:  # type: ignore[override]
        super().initialize(context)
        self.dashboard = dashboard

    def set_default_headers(self) -> None:
        super().set_default_headers()
        for name, value in SECURITY_HEADERS.items():
            self.set_header(name, value)
        self.set_header("Cache-Control", "no-store")

    def get_template_path(self) -> str:
        return TEMPLATES

    # ------------------------------------------------------------ sessions
    def cookie_token(self) -> str:
        return session_token(self.get_cookie(COOKIE), self.dashboard.settings)

    def set_session_cookie(self, token: str) -> None:
        signed = create_signed_value(self.dashboard.settings.server.cookie_secret, COOKIE, token)
        # No Expires: a browser session cookie; the server enforces both timeouts.
        self.set_cookie(COOKIE, signed.decode("ascii"), path="/", httponly=True, samesite="Lax",
                        secure=self.dashboard.secure_cookies)

    def clear_session_cookie(self) -> None:
        self.clear_cookie(COOKIE, path="/", httponly=True, samesite="Lax",
                          secure=self.dashboard.secure_cookies)

    async def prepare(self) -> None:
        if self.public:
            return
        token = self.cookie_token()
        session = await self.core(resume, token, idle=self.dashboard.idle) if token else None
        if session is None:
            if self.request.method in SAFE_METHODS:
                self.redirect("/login", status=303)
                return
            # No session cookie came: it ended, or the form was sent from
            # another site (the browser withholds the cookie then).
            raise PageError(403, "This form came without a live session, so nothing was "
                                 "changed. If you sent it, log in again with a new link.")
        self.session, self.session_token = session, token
        if self.request.method not in SAFE_METHODS:
            presented = (self.get_body_argument("_xsrf", None)
                         if self.request.headers.get("Content-Type", "").startswith(
                             ("application/x-www-form-urlencoded", "multipart/form-data"))
                         else None) or self.request.headers.get("X-XSRF-Token")
            if not check_xsrf(self.dashboard.settings.server.cookie_secret, token, presented):
                raise PageError(403, "The form was not sent from this dashboard session "
                                     "(XSRF check failed). Reload the page and try again.")

    @property
    def actor(self) -> Any:
        assert self.session is not None
        return self.session.actor

    @property
    def xsrf(self) -> str:
        return xsrf_token(self.dashboard.settings.server.cookie_secret, self.session_token)

    # ------------------------------------------------------------ service layer
    async def core_raw(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """Run a service-layer call off the loop, in its user's turn; its errors
        come back as they are (a 503 page when too many of the user's calls wait)."""
        loop = IOLoop.current()
        session = getattr(self, "session", None)
        if session is None:
            # Resuming a session or logging in (one indexed lookup): straight to
            # the pool, as anyone's; turns are by user, and there is none yet.
            return await loop.run_in_executor(self.dashboard.executor, partial(fn, *args, **kw))
        try:
            return await self.dashboard.calls.run(session.actor.label, lambda: loop.run_in_executor(
                self.dashboard.executor, partial(fn, *args, **kw)))
        except BusyError as err:
            raise PageError(503, err.message, headers={"Retry-After": "1"}) from None

    async def core(self, fn: Callable[..., T], *args: Any, deny: int = 404, **kw: Any) -> T:
        """Run a service-layer call off the loop.  Not found, and refusals
        when `deny` is 404, become a 404 page: a stranger learns nothing."""
        try:
            return await self.core_raw(fn, *args, **kw)
        except NotFoundError as err:
            if err.code == "invalid_login_token":
                raise
            raise PageError(404, "Not found.") from None
        except PermissionDeniedError as err:
            if deny == 404:
                raise PageError(404, "Not found.") from None
            raise PageError(deny, err.message) from None

    # ------------------------------------------------------------ rendering
    def get_template_namespace(self) -> dict[str, Any]:
        namespace = super().get_template_namespace()
        namespace.update(user_id=self.session.user_id if self.session else None,
                         xsrf=self.xsrf if self.session else "", time_html=time_html,
                         static=static_url)
        return namespace

    def page(self, template: str, status: int = 200, **kw: Any) -> None:
        self.set_status(status)
        self.render(template, **kw)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if database_lost(exc):
            exc = (PageError(503, "The database cannot be reached just now; retry in a moment.",
                             headers={"Retry-After": "1"})
                   if self.request.method in ("GET", "HEAD") else
                   PageError(503, "The database connection was lost: the change may or may not "
                                  "have been made. Reload the page to see."))
        if isinstance(exc, PageError):
            status, message = exc.status, exc.message
            for name, value in exc.headers.items():
                self.set_header(name, value)
        elif isinstance(exc, CoreError):
            status, message = exc.status, exc.message
        elif isinstance(exc, HTTPError) and status_code < 500:
            status, message = status_code, "This request cannot be answered."
        else:
            status, message = status_code, "Something went wrong on our side."
        self.set_status(status)
        # Only the service's own failure counts as one (a WARNING access line,
        # `logic.access`); a 503 page is the dashboard being busy or its
        # database unreachable, which is logged once per interval.
        self.error_code = ("internal_error" if status >= 500 and status != 503
                           else "busy" if status == 503 else "dashboard_error")
        if self.request.headers.get("Accept", "").startswith("application/json"):
            self.write_json({"success": False, "error": {"code": f"http_{status}",
                                                         "message": message,
                                                         "requestId": self.request_id}}, status)
            return
        self.render("error.html", status=status, message=message, title=f"Error {status}")

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        if isinstance(value, (PageError, CoreError)):
            return
        super().log_exception(typ, value, tb)


class DashboardNotFoundHandler(DashboardHandler):
    """Any path under `/dashboard` no route matches: the dashboard's 404 page, with
    its headers (not the API's JSON 404), for every method and without a session."""

    public = True

    async def prepare(self) -> None:
        raise PageError(404, "Not found.")


#: The files under `static/` the dashboard serves, by suffix, and their types.
_STATIC_TYPES = {".css": "text/css; charset=UTF-8", ".js": "application/javascript; charset=UTF-8"}
#: Ten years: a changed file gets a new versioned URL (`static_url`).
_STATIC_MAX_AGE = 10 * 365 * 24 * 3600


@lru_cache(maxsize=16)
def _static_file(name: str, mtime_ns: int) -> tuple[bytes, str]:
    """A static file's bytes and ETag, read once per modification."""
    data = (HERE / "static" / name).read_bytes()
    return data, '"' + hashlib.sha256(data).hexdigest()[:32] + '"'


class DashboardStaticHandler(DashboardHandler):
    """The dashboard's own CSS and JavaScript, with the pages' headers.

    Only the files present in `static/` at start-up are served, looked up by
    name (no path is ever built from the request: a NUL, `..` or any other
    name is the dashboard's 404 page, never a traceback or a log line).

    Caching: these files are the same for everyone and hold nothing private,
    so unlike the pages they may be cached.  At the versioned URL the pages
    link (`static_url`: `?v=` the file's modification time) for ten years
    (`max-age`), since a changed file gets a new URL; without a version the
    browser revalidates each time (`no-cache`, by ETag).  Error answers (an
    unknown file) are `no-store` like the pages.
    """

    public = True
    FILES = frozenset(p.name for p in (HERE / "static").iterdir()
                      if p.suffix in _STATIC_TYPES and p.is_file())

    def get(self, name: str) -> None:
        self._serve(name, include_body=True)

    def head(self, name: str) -> None:
        self._serve(name, include_body=False)

    def _serve(self, name: str, include_body: bool) -> None:
        if name not in self.FILES:
            raise PageError(404, "Not found.")
        try:
            mtime_ns = (HERE / "static" / name).stat().st_mtime_ns
            data, etag = _static_file(name, mtime_ns)
        except OSError:
            raise PageError(404, "Not found.") from None
        self.set_header("Cache-Control", f"max-age={_STATIC_MAX_AGE}"
                        if "v" in self.request.arguments else "no-cache")
        self.set_header("Etag", etag)
        self.set_header("Content-Type", _STATIC_TYPES[os.path.splitext(name)[1]])
        if etag in {t.strip() for t in
                    self.request.headers.get("If-None-Match", "").split(",")}:
            self.set_status(304)
            self.finish()
            return
        if include_body:
            self.finish(data)
        else:
            self.set_header("Content-Length", str(len(data)))
            self.finish()
