"""The chat platform, played by the tests: a real Ed25519 key pair signs interactions
sent to a real `logic serve`; a local HTTP server takes the follow-ups.

The real platform cannot be reached from this machine (no outbound network),
so what it does is played here, byte for byte as its public Interactions
protocol describes: `X-Signature-Ed25519` = Ed25519 over
`X-Signature-Timestamp` + raw body, with the application's private key.
"""
from __future__ import annotations

import itertools
import json
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from nacl.signing import SigningKey

from tests.service.http.conftest import CONFIG, Env, bind, http_env  # noqa: F401  (fixtures)
from tests.service.http.harness import Response, Server

APP_ID = "900000000000000001"
OWNER, MANAGER, STRANGER = "111111111111111111", "222222222222222222", "333333333333333333"
_guild_ids = itertools.count(70_000_000)


def _snowflake() -> str:
    """A fresh interaction id: random, since every server of a test session shares one
    database, where an id once answered is refused forever after (a replay)."""
    return str(10**18 + secrets.randbelow(10**18))


def options_for(path: tuple[str, ...], options: dict[str, str], focused: str | None) -> list[Any]:
    """Nested protocol options: group, subcommand, then the leaf's string options."""
    leaf: list[Any] = [{"type": 3, "name": k, "value": v, **({"focused": True} if k == focused else {})}
                       for k, v in options.items()]
    for i, name in reversed(list(enumerate(path))):
        kind = 2 if i < len(path) - 1 else 1
        leaf = [{"type": kind, "name": name, "options": leaf}]
    return leaf


@dataclass
class Platform:
    """Signs and sends interactions the way the platform does."""

    server: Server
    key: SigningKey = field(default_factory=SigningKey.generate)
    path: str = "/interactions"

    @property
    def public_key(self) -> str:
        return self.key.verify_key.encode().hex()

    def headers(self, body: bytes, timestamp: str | None = None,
                key: SigningKey | None = None) -> dict[str, str]:
        ts = timestamp if timestamp is not None else str(int(time.time()))
        signature = (key or self.key).sign(ts.encode() + body).signature.hex()
        return {"X-Signature-Ed25519": signature, "X-Signature-Timestamp": ts,
                "Content-Type": "application/json", "User-Agent": "Discord-Interactions/1.0"}

    def post(self, body: bytes, headers: dict[str, str]) -> Response:
        return self.server.request(self.path, body=body, headers=headers)

    def send(self, payload: Any) -> Response:
        body = json.dumps(payload).encode()
        return self.post(body, self.headers(body))

    def interaction(self, kind: int, *, guild_id: str | None, user_id: str,
                    path: tuple[str, ...] = (), options: dict[str, str] | None = None,
                    focused: str | None = None) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "id": _snowflake(), "application_id": APP_ID, "type": kind,
            "token": "aW50ZXJhY3Rpb246" + secrets.token_urlsafe(48), "version": 1,
            "channel_id": "600000000000000001", "locale": "en-US",
            "data": {"id": "500000000000000001", "name": path[0] if path else "logic", "type": 1,
                     "options": options_for(path[1:], options or {}, focused)},
        }
        user = {"id": user_id, "username": f"u{user_id[:4]}", "discriminator": "0"}
        if guild_id is None:
            payload["user"] = user
        else:
            payload["guild_id"] = guild_id
            payload["member"] = {"user": user, "permissions": "32", "roles": []}
        return payload

    def command(self, *path: str, guild_id: str | None, user_id: str, **options: str) -> Response:
        return self.send(self.interaction(2, guild_id=guild_id, user_id=user_id, path=path,
                                          options=options))

    def autocomplete(self, *path: str, guild_id: str, user_id: str, typed: str) -> Response:
        return self.send(self.interaction(4, guild_id=guild_id, user_id=user_id, path=path,
                                          options={"script": typed}, focused="script"))


@dataclass
class Received:
    method: str
    path: str
    body: Any


class PlatformAPI:
    """A local HTTP server in the platform API's place: records the follow-ups."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        #: Answers for the next calls, in order (status, extra headers); then `status`.
        self.script: list[tuple[int, dict[str, str]]] = []
        #: Bytes of padding in each answer (a platform answering far too much).
        self.answer_bytes = 0
        #: Seconds each answer takes (a platform slow to take edits).
        self.delay = 0.0
        self.received: list[Received] = []
        self.arrived = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_PATCH(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"null")
                outer.received.append(Received("PATCH", self.path, body))
                time.sleep(outer.delay)
                answer = json.dumps({"id": "1", "content": body.get("content", "")}).encode()
                status, extra = outer.script.pop(0) if outer.script else (outer.status, {})
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                for name, value in extra.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(answer) + outer.answer_bytes))
                self.end_headers()
                self.wfile.write(answer)
                for _ in range(outer.answer_bytes >> 20):
                    self.wfile.write(bytes(1 << 20))
                outer.arrived.set()

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

        class Listener(ThreadingHTTPServer):
            request_queue_size = 128   # a burst of edits is not refused at connect

        self.httpd = Listener(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/api/v10"

    def wait(self, count: int = 1, timeout: float = 20.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        while len(self.received) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.received

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def start_chat_server(env: Env, tmp_path: Path, key: SigningKey | None, *,
                      path: str = "/interactions", api_url: str | None = None,
                      answer_within_ms: int | None = None, database_url: str | None = None,
                      base_url: str = "https://logic.example.com") -> Server:
    lines = ["[server]", f'base_url = "{base_url}"', "[chat]", f'path = "{path}"']
    if key is not None:
        lines.append(f'public_key = "{key.verify_key.encode().hex()}"')
    if api_url:
        lines.append(f'api_url = "{api_url}"')
    if answer_within_ms is not None:
        lines.append(f"answer_within_ms = {answer_within_ms}")
    name = f"chat-{uuid.uuid4().hex[:8]}"
    # Each server its own records journal: several may share one database.
    lines += ["[records]", f'journal = "{tmp_path / (name + "-journal")}"']
    config = tmp_path / f"{name}.toml"
    config.write_text("\n".join(lines) + "\n" + CONFIG)
    return Server(database_url or env.database_url, str(config),
                  extra_args=["--workers", "1"]).start()


@pytest.fixture(scope="module")
def platform(http_env: Env, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
             ) -> Iterator[Platform]:
    key = SigningKey.generate()
    srv = start_chat_server(http_env, tmp_path_factory.mktemp("chat"), key)
    yield Platform(srv, key)
    srv.stop()


@dataclass
class Guild:
    guild_id: str
    script_id: str
    name: str
    other_id: str


@pytest.fixture()
def make_guild(http_env: Env, bind: Callable[[], None]  # noqa: F811
               ) -> Callable[..., Guild]:
    """A guild (owner OWNER, manager MANAGER) with two scripts; the first one's endpoint enabled."""
    from service.core import endpoints, guilds, scripts
    from service.core.access import Actor

    def make(plan: str = "pro", enabled: bool = True) -> Guild:
        bind()
        guild_id = str(next(_guild_ids))
        owner = Actor.user(OWNER)
        guilds.create_guild(Actor.operator(), guild_id, OWNER, plan, plans=http_env.plans)
        guilds.add_manager(owner, guild_id, MANAGER, plans=http_env.plans)
        name = f"alpha-{guild_id}"
        script_id = scripts.create_script(owner, guild_id, name, ECHO)["logicScriptId"]
        other = scripts.create_script(owner, guild_id, f"beta-{guild_id}", ECHO)["logicScriptId"]
        if enabled:
            endpoints.enable_endpoint(owner, guild_id, script_id, plans=http_env.plans)
        return Guild(guild_id, script_id, name, other)

    return make


ECHO = """
on endpoint(event):
    event.reply({"ok": True, "body": event.body})
"""
