"""Logging in with a one-time link, the login help page, logging out.

`GET /login/{token}` consumes the link (`service.core.sessions.login`), sets
the session cookie and redirects to `/dashboard`: after it, neither the link
nor the session appears in any URL.  A link of another user than the
browser's live session is not used at once (any site can make a browser open
a link, and the owner of any guild can get one for himself): a page asks,
and only its XSRF-checked `POST /login/{token}` ends the session and logs in.
"""
from __future__ import annotations

from typing import Any

from service.core.errors import NotFoundError
from service.core.sessions import end_session, link_user, login, resume
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
    """`GET /login/{token}`: the one-time link; `POST /login/{token}`: the same,
    confirmed from the page asking whether to leave a live session of another user."""

    async def prepare(self) -> None:
        # The POST comes only from that page: it needs the session and its XSRF token.
        self.public = self.request.method != "POST"
        await super().prepare()

    async def get(self, token: str) -> None:
        old = self.cookie_token()
        current = await self.core(resume, old, idle=self.dashboard.idle) if old else None
        if current is not None:
            try:
                user = await self.core(link_user, token)
            except NotFoundError:
                self._refused()
                return
            if user != current.user_id:
                self.session, self.session_token = current, old
                self.page("login_switch.html", title="Log in as another user?", link_user=user,
                          token=token)
                return
        await self._login(token, old)

    async def post(self, token: str) -> None:
        await self._login(token, self.session_token)

    async def _login(self, token: str, old: str) -> None:
        try:
            session_token, _ = await self.core(login, token, absolute=self.dashboard.absolute)
        except NotFoundError:
            self._refused()
            return
        if old:
            await self.core(end_session, old)
        self.set_session_cookie(session_token)
        self.redirect("/dashboard", status=303)

    def _refused(self) -> None:
        self.session, self.session_token = None, ""
        self.page("login.html", status=400, title="Login link refused", refused=True,
                  logged_out=False)


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
