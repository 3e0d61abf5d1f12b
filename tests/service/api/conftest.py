"""Fixtures for the admin API: a real `logic serve` on SQLite and PostgreSQL (the
end-to-end fixtures of tests/service/http), tokens made through the service layer,
and a small JSON client."""
from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from tests.service.http.conftest import (Env, bind, http_env, make_endpoint,  # noqa: F401
                                         make_server, server, source_ip)
from tests.service.http.harness import Response, Server

OWNER_ID, MANAGER_ID, STRANGER_ID = "4242", "5353", "6464"
ECHO = 'on endpoint(event):\n    print("got", event.body)\n    event.reply({"echo": event.body})\n'
_guilds = itertools.count(50_000)


@dataclass
class Api:
    """A JSON client for one token on one server."""

    server: Server
    token: str | None
    acting: str | None = None
    ip: str | None = None

    def __call__(self, method: str, path: str, body: Any = None,
                 headers: dict[str, str] | None = None, timeout: float = 10.0) -> Response:
        hdrs = dict(headers or {})
        if self.acting:
            hdrs["X-Acting-User"] = self.acting
        if body is not None:
            hdrs.setdefault("Content-Type", "application/json")
        return self.server.request(
            "/api/v1" + path, method=method, secret=self.token, headers=hdrs,
            body=json.dumps(body) if body is not None else None, source_ip=self.ip,
            timeout=timeout)

    def as_user(self, user_id: str) -> Api:
        return Api(self.server, self.token, user_id, self.ip)


@dataclass
class World:
    """Tokens for every role, and a guild with a script (plan `pro` unless asked)."""

    operator: Api
    owner: Api
    manager: Api
    stranger: Api
    guild_id: str
    script_id: str

    @property
    def script_path(self) -> str:
        return f"/guilds/{self.guild_id}/scripts/{self.script_id}"


@pytest.fixture()
def make_token(http_env: Env, bind: Callable[[], None]) -> Callable[..., dict[str, Any]]:
    from service.core import tokens
    from service.core.access import Actor

    def make(user_id: str | None = None, **kw: Any) -> dict[str, Any]:
        bind()
        return tokens.create_api_token(Actor.operator(), user_id, **kw)

    return make


@pytest.fixture()
def world(server: Server, make_token: Callable[..., dict[str, Any]]) -> Callable[..., World]:
    def make(plan: str = "pro") -> World:
        op = Api(server, make_token(None)["token"])
        gid = str(next(_guilds))
        assert op("POST", "/guilds", {"guildId": gid, "ownerId": OWNER_ID, "plan": plan}).status == 201
        owner = Api(server, make_token(OWNER_ID)["token"])
        assert owner("PUT", f"/guilds/{gid}/managers/{MANAGER_ID}").status == 200
        created = owner("POST", f"/guilds/{gid}/scripts", {"name": "echo", "source": ECHO})
        assert created.status == 201, created.body
        return World(op, owner, Api(server, make_token(MANAGER_ID)["token"]),
                     Api(server, make_token(STRANGER_ID)["token"]), gid,
                     created.json["logicScriptId"])

    return make


def assert_error(resp: Response, status: int, code: str) -> dict[str, Any]:
    """The contract's error envelope, with the request id echoed in the header."""
    assert resp.status == status, (resp.status, resp.body[:500])
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json
    assert body["success"] is False and body["error"]["code"] == code, body
    assert body["error"]["message"]
    assert body["error"]["requestId"] == resp.headers["x-request-id"]
    return body["error"]  # type: ignore[no-any-return]
