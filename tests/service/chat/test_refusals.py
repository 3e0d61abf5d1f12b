"""Requests that are not the platform's: 401 before parsing, without touching the database.

"Without touching the database" is watched from outside the server.  On
PostgreSQL the server runs with its own `application_name`, and
`pg_stat_activity` (live, not sampled) shows the start time of the last
statement each of its connections ran: the refused requests leave it
unchanged, one accepted command (the control) changes it.  A SQLite
connection cannot be watched that way; there the test shows, in /proc,
that the refused requests started none of the threads every database call
of the chat command runs on, while the accepted command started one.
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from nacl.signing import SigningKey

from service.chat.signature import MAX_AGE_S
from tests.service.chat.conftest import OWNER, Guild, Platform, start_chat_server
from tests.service.http.harness import Response, wait_until


def assert_401(resp: Response) -> None:
    assert resp.status == 401, resp.body
    body = resp.json
    assert body["success"] is False
    assert body["error"]["code"] == "unauthorized"
    assert body["error"]["requestId"] == resp.headers["x-request-id"]


def refused_requests(platform: Platform, payload: dict[str, Any]) -> dict[str, Response]:
    """Each way a request can fail the signature check, for a command that would otherwise run."""
    body = json.dumps(payload).encode()
    good = platform.headers(body)
    altered = body.replace(b'"list"', b'"lisT"')
    assert altered != body
    # Well outside the window, and made when sent: `int(time.time()) + 301`
    # made before the requests ahead of it was inside the window again once
    # the second had turned (the exact bound is test_signature.py's).
    def skewed(seconds: int) -> dict[str, str]:
        return platform.headers(body, timestamp=str(int(time.time()) + seconds))
    return {
        "no signature": platform.post(body, {k: v for k, v in good.items()
                                             if k != "X-Signature-Ed25519"}),
        "no timestamp": platform.post(body, {k: v for k, v in good.items()
                                             if k != "X-Signature-Timestamp"}),
        "no headers": platform.post(body, {"Content-Type": "application/json"}),
        "other key": platform.post(body, platform.headers(body, key=SigningKey.generate())),
        "body altered after signing": platform.post(altered, good),
        "timestamp altered after signing": platform.post(
            body, {**good, "X-Signature-Timestamp": str(int(good["X-Signature-Timestamp"]) + 1)}),
        "old timestamp": platform.post(body, skewed(-MAX_AGE_S - 30)),
        "future timestamp": platform.post(body, skewed(MAX_AGE_S + 30)),
        "signature not hex": platform.post(body, {**good, "X-Signature-Ed25519": "zz" * 64}),
        "empty body": platform.post(b"", platform.headers(body)),
        # Review, session 33: unsigned bodies the framework's form parsing
        # refused (400) before the signature check could answer 401.
        "unsigned malformed multipart": platform.post(
            b"garbage", {"Content-Type": "multipart/form-data; boundary=zz"}),
        "unsigned coded body": platform.post(
            b"garbage", {"Content-Type": "application/json", "Content-Encoding": "gzip"}),
    }


def _activity(db: Any, app_name: str) -> list[tuple[Any, ...]]:
    cursor = db.execute_sql(
        "SELECT pid, backend_start, query_start, state_change FROM pg_stat_activity "
        "WHERE application_name = %s ORDER BY pid", (app_name,))
    return [tuple(row) for row in cursor.fetchall()]


def _threads(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


def _settled_threads(pid: int) -> int:
    """The thread count once it has not changed for half a second."""
    last = -1
    for _ in range(40):
        now = _threads(pid)
        if now == last:
            return now
        last = now
        time.sleep(0.5)
    raise AssertionError("the server's threads never settled")


def test_bad_signatures_are_401_and_never_reach_the_database(http_env: Any, make_guild: Any,
                                                             tmp_path: Path) -> None:
    g: Guild = make_guild()
    key = SigningKey.generate()
    pg = not http_env.database_url.startswith("sqlite")
    app_name = f"logic-chat-{uuid.uuid4().hex[:12]}"
    url = http_env.database_url + (f"&application_name={app_name}" if pg else "")
    server = start_chat_server(http_env, tmp_path, key, database_url=url)
    try:
        platform = Platform(server, key)
        payload = platform.interaction(2, guild_id=g.guild_id, user_id=OWNER,
                                       path=("logic", "script", "list"))
        pid = server.proc.pid if server.proc else 0
        if pg:
            # The record writer connects (and runs nothing) just after start-up.
            assert wait_until(lambda: len(_activity(http_env.db, app_name)) == 1)
        else:
            # The record writer's thread starts just after start-up.
            threads = _settled_threads(pid)
        before = _activity(http_env.db, app_name) if pg else []
        results = refused_requests(platform, payload)
        for why, resp in results.items():
            assert resp.status == 401, why
            assert_401(resp)
        if pg:
            # Still only the record writer's idle connection: no statement ran.
            assert _activity(http_env.db, app_name) == before
            assert before[0][2] is None, "no statement since start-up"
        else:
            # No chat thread (where every database call of the command runs) started.
            assert _threads(pid) == threads
        # The control: the same command, correctly signed, does reach the database.
        accepted = platform.send(payload)
        assert accepted.status == 200 and g.script_id in accepted.json["data"]["content"]
        if pg:
            after = _activity(http_env.db, app_name)
            assert after != before and len(after) > len(before)
        else:
            assert _threads(pid) == threads + 1  # the chat thread, started for it
    finally:
        server.stop()
    from service.core import audit_log
    from service.core.access import Actor
    actions = [r["action"] for r in audit_log(Actor.operator(), g.guild_id)["audit"]]
    assert "endpoint.enabled" in actions and not [a for a in actions if "chat" in a]


def test_without_a_public_key_the_path_is_404_for_everyone(http_env: Any, make_guild: Any,
                                                           tmp_path: Path) -> None:
    g: Guild = make_guild()
    server = start_chat_server(http_env, tmp_path, key=None)
    try:
        platform = Platform(server)  # signs with a key the server was never given
        payload = platform.interaction(2, guild_id=g.guild_id, user_id=OWNER,
                                       path=("logic", "script", "secret"),
                                       options={"script": g.script_id})
        for resp in (platform.send(payload), platform.send({"type": 1}),
                     server.request("/interactions", body=b'{"type": 1}')):
            assert resp.status == 404 and resp.code == "not_found"
        assert "chat command off" in server.log
    finally:
        server.stop()


def test_configured_path_and_only_post(http_env: Any, tmp_path: Path) -> None:
    key = SigningKey.generate()
    server = start_chat_server(http_env, tmp_path, key, path="/hooks/chat")
    try:
        platform = Platform(server, key, path="/hooks/chat")
        assert platform.send({"type": 1, "id": "1", "application_id": "1"}).json == {"type": 1}
        assert Platform(server, key).send({"type": 1}).status == 404  # the default path is not served
        resp = server.request("/hooks/chat", method="GET")
        assert resp.status == 405 and resp.code == "method_not_allowed"
    finally:
        server.stop()


@pytest.mark.parametrize("size", [65 * 1024])
def test_oversized_body_is_refused(platform: Platform, size: int) -> None:
    body = b"{" + b" " * size + b"}"
    resp = platform.post(body, platform.headers(body))
    assert resp.status == 413 and resp.code == "payload_too_large"


@pytest.mark.parametrize("size", [1 << 20, 10 << 20], ids=["within-the-backstop", "10-MiB"])
def test_an_oversized_body_is_refused_when_the_head_arrives(platform: Platform,
                                                            size: int) -> None:
    """docs/security.md: a body over 64 KiB to the chat path is refused 413
    when the head arrives, before a byte of it is read: a client that sends
    only the head gets the 413 and the connection closed at once. (1 MiB is
    within the front's backstop, the largest plan's body, so only the chat
    path's own cap refuses it there; without that cap the server waited for
    the body and the handler's 413 came only after it.)"""
    head = (f"POST {platform.path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"X-Signature-Ed25519: {'00' * 64}\r\nX-Signature-Timestamp: {int(time.time())}\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", platform.server.port), timeout=10) as sock:
        sock.sendall(head)
        sock.settimeout(2.0)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except TimeoutError:
            pass
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert time.monotonic() - started < 2.0   # and closed: the read above saw its end


def test_a_flood_of_unsigned_interactions_logs_a_line_per_interval(http_env: Any,
                                                                   tmp_path: Path) -> None:
    # Security review, session 16: each refused interaction logged one INFO
    # line (4,528 requests in 2 s, 4,528 lines). Now one line per kind of
    # refusal per 10 s, with the count.
    key = SigningKey.generate()
    server = start_chat_server(http_env, tmp_path, key)
    try:
        platform = Platform(server, key)
        body = b'{"type": 1}'
        before = len(server.log_lines)
        for _ in range(60):
            assert_401(platform.post(body, {"Content-Type": "application/json"}))
        for _ in range(40):
            assert_401(platform.post(body, platform.headers(body, key=SigningKey.generate())))
        time.sleep(0.3)
        refusals = [line for line in server.log_lines[before:] if "interaction refused" in line]
        assert len(refusals) == 2, refusals          # one per kind: missing, bad signature
        assert "missing signature header" in refusals[0] and "bad signature" in refusals[1]
    finally:
        server.stop()
