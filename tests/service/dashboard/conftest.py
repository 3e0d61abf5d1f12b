"""Fixtures for the dashboard: a real `logic serve` on SQLite per test module, guilds,
scripts and login links made through the service layer, and a small cookie-keeping
HTTP client for the tests that need no browser."""
from __future__ import annotations

import html
import http.client
import itertools
import re
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from tests.service.http.harness import LOGIC, Response, Server

OWNER, MANAGER, STRANGER = "4242", "5353", "6464"
_guild_ids = itertools.count(70_000)
ARTIFACTS = Path(__file__).resolve().parents[3] / "artifacts" / "dashboard"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Site:
    """A running `logic serve` and the database it uses."""

    server: Server
    db: Any
    plans: Any
    base_url: str

    def bind(self) -> None:
        from models.db import database
        database.initialize(self.db)

    def link(self, user_id: str, **kw: Any) -> str:
        """A one-time login path `/login/...` for the user."""
        from service import core
        self.bind()
        url = core.create_login_link(core.Actor.operator(), user_id, self.base_url, **kw)["url"]
        return str(url)[len(self.base_url):]

    def guild(self, plan: str = "pro", managers: tuple[str, ...] = (MANAGER,)) -> str:
        from service import core
        self.bind()
        gid = str(next(_guild_ids))
        core.create_guild(core.Actor.operator(), gid, OWNER, plan, plans=self.plans)
        for m in managers:
            core.add_manager(core.Actor.operator(), gid, m, plans=self.plans)
        return gid

    def script(self, guild_id: str, source: str, name: str = "scores") -> str:
        from service import core
        self.bind()
        return str(core.create_script(core.Actor.user(OWNER), guild_id, name, source)["logicScriptId"])

    def enable_with_secret(self, guild_id: str, script_id: str) -> str:
        from service import core
        self.bind()
        owner = core.Actor.user(OWNER)
        core.enable_endpoint(owner, guild_id, script_id, plans=self.plans)
        return str(core.regenerate_secret(owner, guild_id, script_id)["secret"])

    def invoke(self, guild_id: str, script_id: str, secret: str, body: Any,
               **kw: Any) -> Response:
        return self.server.request(f"/endpoints/{guild_id}/{script_id}", secret=secret,
                                   json_body=body, **kw)


def start_site(tmp: Path, env: dict[str, str] | None = None) -> Site:
    from models.db import open_database
    from service.settings import load_settings

    url = f"sqlite:///{tmp / 'logic.db'}"
    subprocess.run([LOGIC, "--database-url", url, "db", "upgrade"], check=True, capture_output=True)
    port = free_port()
    base_url = (env or {}).get("LOGIC_SERVER_BASE_URL", f"http://127.0.0.1:{port}")
    server = Server(url, extra_args=["--port", str(port)],
                    env={"LOGIC_SANDBOX_WORKERS": "2", "LOGIC_SERVER_BASE_URL": base_url,
                         **(env or {})}).start()
    settings = load_settings(None, env={"LOGIC_SERVER_BASE_URL": base_url})
    # The links are made as the server makes them: with the base URL as parsed.
    return Site(server, open_database(url), settings.plans, settings.server.base_url)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    s = start_site(tmp_path_factory.mktemp("dash"))
    yield s
    s.server.stop()
    s.db.close()


@dataclass
class Client:
    """A cookie-keeping HTTP client for one user (no browser)."""

    server: Server
    cookies: dict[str, str] = field(default_factory=dict)
    last: Response | None = None

    def request(self, method: str, path: str, form: dict[str, str] | None = None,
                headers: dict[str, str] | None = None) -> Response:
        hdrs = dict(headers or {})
        if self.cookies:
            hdrs["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        body = None
        if form is not None:
            body = urlencode(form)
            hdrs["Content-Type"] = "application/x-www-form-urlencoded"
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            raw = resp.getheaders()
            out = Response(resp.status, {k.lower(): v for k, v in raw}, resp.read(), raw)
        finally:
            conn.close()
        for name, value in raw:
            if name.lower() == "set-cookie":
                key, _, rest = value.partition("=")
                cookie_value = rest.split(";", 1)[0]
                if cookie_value in ("", '""') or "expires=Thu, 01 Jan 1970" in value or "Max-Age=0" in value:
                    self.cookies.pop(key, None)
                else:
                    self.cookies[key] = cookie_value
        self.last = out
        return out

    def get(self, path: str) -> Response:
        return self.request("GET", path)

    def post(self, path: str, form: dict[str, str], **kw: Any) -> Response:
        return self.request("POST", path, form, **kw)

    def xsrf(self, page: str = "/dashboard") -> str:
        text = self.get(page).body.decode()
        match = re.search(r'<meta name="xsrf-token" content="([^"]*)"', text)
        assert match, text[:500]
        return html.unescape(match.group(1))

    def login(self, link: str) -> Response:
        resp = self.get(link)
        assert resp.status == 303 and resp.headers["location"] == "/dashboard", resp.body[:300]
        return resp


@pytest.fixture()
def client(site: Site) -> Client:
    return Client(site.server)
