"""Logging in with a one-time link, the login help page, logging out.

`GET /login/{token}` consumes the link (`service.core.sessions.login`), sets
the session cookie and redirects to `/dashboard`: after it, neither the link
nor the session appears in any URL.
"""
from __future__ import annotations

from typing import Any

from service.core.errors import NotFoundError
from service.core.sessions import end_session, login
from service.dashboard.base import DashboardHandler


class _LinkHandler(DashboardHandler):
    """A handler of `/login/...` paths, which may hold a link's token."""

    public = True

    def initialize(self, context: Any, dashboard: Any) -> None:  # type: ignore[override]
        super().initialize(context, dashboard)
        # The access log names the request path: never with the link's token in
        # it, whatever the method (a HEAD or POST answered 405 is logged too).
        self.request.path = "/login/…"
        self.request.uri = "/login/…"


class LoginHandler(_LinkHandler):
    """`GET /login/{token}`: the one-time link."""

    async def get(self, token: str) -> None:
        try:
            session_token, _ = await self.core(login, token, absolute=self.dashboard.absolute)
        except NotFoundError:
            self.page("login.html", status=400, title="Login link refused", refused=True,
                      logged_out=False)
            return
        old = self.cookie_token()
        if old:
            await self.core(end_session, old)
        self.set_session_cookie(session_token)
        self.redirect("/dashboard", status=303)


class MalformedLinkHandler(_LinkHandler):
    """`GET /login/...` that no link can be (too long, other characters): refused
    like a used link, consuming nothing, with the dashboard's headers."""

    def get(self) -> None:
        self.page("login.html", status=400, title="Login link refused", refused=True,
                  logged_out=False)


class LoginHelpHandler(DashboardHandler):
    """`GET /login`: where a visitor without a session lands."""

    public = True

    def get(self) -> None:
        self.page("login.html", title="Log in", refused=False, logged_out=False)


class LogoutHandler(DashboardHandler):
    """`POST /logout` (XSRF-checked): end this session and forget the cookie."""

    async def post(self) -> None:
        await self.core(end_session, self.session_token)
        self.clear_session_cookie()
        self.session, self.session_token = None, ""
        self.page("login.html", title="Logged out", refused=False, logged_out=True)
