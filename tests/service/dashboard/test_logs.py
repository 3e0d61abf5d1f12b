"""A login link's token never reaches the service's log (the access log names paths)."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from tornado.httpclient import AsyncHTTPClient
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets

from service import core
from service.http.app import make_app
from service.http.metrics import Metrics
from service.settings import load_settings


def test_the_access_log_never_holds_the_login_token(db, caplog: pytest.LogCaptureFixture) -> None:
    settings = load_settings(None, env={"LOGIC_SERVER_COOKIE_SECRET": "c" * 40})
    url = core.create_login_link(core.Actor.operator(), "100", "http://x")["url"]
    token = url.rsplit("/", 1)[1]

    async def run() -> list[int]:
        sockets = bind_sockets(0, "127.0.0.1")
        port = sockets[0].getsockname()[1]
        server = HTTPServer(make_app(SimpleNamespace(settings=settings, change_feed=None,
                                                   metrics=Metrics())))  # type: ignore[arg-type]
        server.add_sockets(sockets)
        client = AsyncHTTPClient()
        codes = []
        try:
            for method, path in (("HEAD", token), ("POST", token), ("OPTIONS", token),
                                 ("PROPFIND", token + "/")):   # 405 (or 403): logged too
                resp = await client.fetch(f"http://127.0.0.1:{port}/login/{path}",
                                          method=method, follow_redirects=False,
                                          raise_error=False, allow_nonstandard_methods=True,
                                          body=b"" if method == "POST" else None)
                codes.append(resp.code)
            # Near misses (a doubled slash from a base URL ending in "/", a
            # link typed in capitals): not the login route, still not logged.
            for path in (f"//login/{token}", f"/LOGIN/{token}", f"/x/Login/{token}/y"):
                resp = await client.fetch(f"http://127.0.0.1:{port}{path}",
                                          follow_redirects=False, raise_error=False)
                codes.append(resp.code)
            for _ in range(2):          # the second time the link is spent
                resp = await client.fetch(f"http://127.0.0.1:{port}/login/{token}",
                                          follow_redirects=False, raise_error=False)
                codes.append(resp.code)
        finally:
            server.stop()
            client.close()
        return codes

    with caplog.at_level(logging.DEBUG, logger="logic.access"):
        codes = asyncio.run(run())
    assert codes[7:] == [303, 400], codes      # the other methods did not spend the link
    assert all(code in (403, 405) for code in codes[:4]), codes
    assert all(code == 404 for code in codes[4:7]), codes
    lines = [r.getMessage() for r in caplog.records if r.name == "logic.access"]
    assert len(lines) == 9 and all("login/…" in line.lower() for line in lines)
    assert token not in caplog.text
