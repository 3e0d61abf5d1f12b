"""A bounded, seeded fuzz run against a real `logic serve`: ~5,000 requests over
methods, paths, headers, content types, charsets and bodies, well-formed and
not. Whatever arrives: no 5xx from the service, no ERROR line in its log, no
secret in its log, and its memory stays bounded."""

from __future__ import annotations

import random
import socket

import psutil

from tests.service.http.harness import Server

REQUESTS = 5_000
SIZE = """
on endpoint(event):
    event.reply({"ok": True, "n": len(event.rawBody), "q": event.query})
"""
SEED = 20261124

METHODS = ["POST", "GET", "PUT", "OPTIONS", "HEAD", "DELETE", "PATCH", "BREW", "P OST", ""]
CONTENT_TYPES = [
    "application/json", "application/json; charset=utf-8", "text/plain; charset=undefined",
    "text/plain; charset=latin1", "application/x-www-form-urlencoded", "application/octet-stream",
    "application/vnd.x+json", "text/csv; charset=\"utf-16\"", "multipart/form-data; boundary=x",
    "text/plain; charset=" + "z" * 300, "", "application/json; charset=rot13",
]
BODIES = [
    b"{}", b'{"a": 1}', b'{"id": 99999999999999999999}', b"-9223372036854775809",
    b'"\\ud800"', b"[" * 5000, b"not json", b"a=1&b=2&b=3", b"\xff\xfe\x00x", b"",
    b'{"n": 1e400}', b"NaN", b'{"deep": ' * 40 + b"1" + b"}" * 40, "café".encode(),
    b"\x00" * 100,
]
VERSIONS = ["HTTP/1.1", "HTTP/1.0", "HTTP/1.2", "HTTP/2.0", "HTTP/0.9", "HTTP/1.1"]


def _request(rng: random.Random, paths: list[str], secret: str) -> bytes:
    # Mostly requests a client would send, so the run reaches the scripts too.
    method = "POST" if rng.random() < 0.7 else rng.choice(METHODS)
    path = paths[0] if rng.random() < 0.6 else rng.choice(paths)
    if rng.random() < 0.2:
        path += "?" + rng.choice(["a=1", f"secret={secret}", f"token={secret}", "x=%ff%00",
                                  "q=" + "w" * 2000])
    version = "HTTP/1.1" if rng.random() < 0.85 else rng.choice(VERSIONS)
    lines = [f"{method} {path} {version}"]
    if rng.random() < 0.95:
        lines.append("Host: t")
    if rng.random() < 0.03:
        lines.append("Host: u")
    auth = rng.random()
    if auth < 0.5:
        lines.append(f"Authorization: Bearer {secret}")
    elif auth < 0.6:
        lines.append(f"Authorization: Bearer {secret} ")  # trailing space
    elif auth < 0.7:
        lines.append(f"X-Service-Secret: {secret}\x01")  # control character
    elif auth < 0.8:
        lines.append(f"X-Service-Secret: lsk_wrong{rng.randrange(10**6)}")
    body = b'{"a": [1, "x"]}' if rng.random() < 0.5 else rng.choice(BODIES)
    ctype = "application/json" if rng.random() < 0.5 else rng.choice(CONTENT_TYPES)
    if ctype:
        lines.append(f"Content-Type: {ctype}")
    framing = rng.random()
    if framing < 0.7:
        lines.append(f"Content-Length: {len(body)}")
        payload = body
    elif framing < 0.8:
        lines.append("Transfer-Encoding: chunked")
        payload = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
    elif framing < 0.85:
        lines.append("Transfer-Encoding: gzip, chunked")
        payload = b"0\r\n\r\n"
    elif framing < 0.9:
        lines.append(f"Content-Length: {len(body)}")
        lines.append(f"Content-Length: {len(body) + 1}")
        payload = body
    else:
        payload = b""
    for _ in range(rng.choice([0, 0, 0, 1, 2, 3])):
        lines.append(rng.choice([
            "X-Junk: " + "v" * rng.randrange(100), "X-Ctl: a\x7fb", "Expect: 100-continue",
            "Connection: keep-alive, Upgrade", "Upgrade: websocket", "TE: trailers",
            "X-Forwarded-For: 10.0.0.1, ::1", "Accept-Charset: utf-8", "X-Api-Key: " + secret,
            "Cookie: session=" + secret, "Range: bytes=0-1", "Bad Header: x", "X-Fold: a\r\n b",
        ]))
    lines.append("Connection: close")
    head = "\r\n".join(lines) + "\r\n\r\n"
    raw = head.encode("latin1")
    if rng.random() < 0.03:
        cut = rng.randrange(len(raw))
        raw = raw[:cut] + bytes([rng.randrange(256)]) + raw[cut + 1:]
    return raw + payload


def _send(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        out = b""
        try:
            while len(out) < 100_000:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                out += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return out


def test_fuzz_run_has_no_5xx_no_error_lines_and_no_secret_in_the_log(
        make_server, make_endpoint) -> None:
    server: Server = make_server()
    ep = make_endpoint(source=SIZE, plan="bench")
    other = make_endpoint(source="on endpoint(event):\n    raise ValueError(str(event.query))\n",
                          plan="bench")
    paths = [ep.path, ep.path + "/", ep.path.replace("logic_", "logic%5F"), other.path,
             "/healthz", "/readyz", "/", "/endpoints/", "/endpoints/1/x", "*",
             "http://t" + ep.path, "/" + "a" * 3000, "/endpoints/%00/%ff", "/../etc/passwd"]
    rng = random.Random(SEED)
    assert server.proc is not None
    proc = psutil.Process(server.proc.pid)
    _send(server.port, b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    before = proc.memory_info().rss
    server_errors = []
    statuses: dict[bytes, int] = {}
    for n in range(REQUESTS):
        secret = ep.secret if rng.random() < 0.8 else other.secret
        answer = _send(server.port, _request(rng, paths, secret))
        status = answer[9:12]
        statuses[status] = statuses.get(status, 0) + 1
        # The failing script's own 500 script_error is the script's, not the
        # service's; 501 and 505 refuse the client's framing and version.
        if status.startswith(b"5") and status not in (b"501", b"505") \
                and b"script_error" not in answer:
            server_errors.append((n, answer[:400]))
    grown = proc.memory_info().rss - before
    log = server.log
    assert server_errors == [], server_errors[:5]
    # The run reached the scripts as well as the parser's refusals.
    assert statuses.get(b"200", 0) > 200 and statuses.get(b"400", 0) > 200, statuses
    assert " ERROR " not in log and "Traceback" not in log, log[-3000:]
    for secret in (ep.secret, other.secret):
        assert secret not in log
    assert grown < 48 * 1024 * 1024, grown
