"""A user with too many dashboard calls running or waiting gets the 503 page."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tornado.httpclient import AsyncHTTPClient
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets

from service import core
from service.dashboard.base import PER_TENANT, Dashboard
from service.http.app import make_app
from service.http.fair import FairCalls
from service.http.metrics import Metrics
from service.settings import load_settings


def test_a_users_call_past_their_bound_gets_the_503_page_with_retry_after(db) -> None:
    # Outside review, session 17: nothing tested the dashboard's side of the
    # per-user bound. The user's calls already at the bound (held here), the
    # next page is the dashboard's 503 page with Retry-After; another user's
    # page is served.
    settings = load_settings(None, env={"LOGIC_SERVER_COOKIE_SECRET": "c" * 40})
    operator = core.Actor.operator()
    core.create_guild(operator, "880001", "100")
    links = {user: core.create_login_link(operator, user, "http://x")["url"].rsplit("/", 1)[1]
             for user in ("100", "200")}

    async def run() -> dict[str, tuple[int, str, str]]:
        app = make_app(SimpleNamespace(settings=settings, change_feed=None,
                                       metrics=Metrics()))  # type: ignore[arg-type]
        dashboards = {id(kw["dashboard"]): kw["dashboard"] for rule in app.wildcard_router.rules
                      for kw in [rule.target_kwargs or {}] if isinstance(kw.get("dashboard"),
                                                                         Dashboard)}
        assert len(dashboards) == 1
        dashboard = next(iter(dashboards.values()))
        assert isinstance(dashboard.calls, FairCalls) and dashboard.calls.per_tenant == PER_TENANT
        sockets = bind_sockets(0, "127.0.0.1")
        port = sockets[0].getsockname()[1]
        server = HTTPServer(app)
        server.add_sockets(sockets)
        client = AsyncHTTPClient()
        release = asyncio.Event()
        held = [asyncio.ensure_future(dashboard.calls.run("user:100", release.wait))
                for _ in range(PER_TENANT)]
        seen = {}
        try:
            for user, token in links.items():
                login = await client.fetch(f"http://127.0.0.1:{port}/login/{token}",
                                           follow_redirects=False, raise_error=False)
                cookie = login.headers.get_list("Set-Cookie")[0].split(";", 1)[0]
                page = await client.fetch(f"http://127.0.0.1:{port}/dashboard", raise_error=False,
                                          headers={"Cookie": cookie}, follow_redirects=False)
                seen[user] = (page.code, page.headers.get("Retry-After", ""),
                              page.body.decode())
        finally:
            release.set()
            await asyncio.gather(*held)
            server.stop()
            client.close()
        return seen

    seen = asyncio.run(run())
    code, retry, body = seen["100"]
    assert code == 503 and retry == "1", seen["100"][:2]
    assert "Too many of your dashboard calls at once" in body and "<html" in body.lower()
    assert seen["200"][0] == 200, seen["200"][:2]
