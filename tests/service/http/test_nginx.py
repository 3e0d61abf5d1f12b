"""The shipped `deploy/nginx.conf`, run by Debian's nginx on loopback.

The service refuses proxy-control and origin-wide headers in script replies
(tests in test_hardening.py). This checks the second line of defence: behind
the shipped configuration, an upstream that *does* send them (a stand-in
upstream here, since the service no longer can) does not get nginx to act on
them, and the browser never sees them.
"""

from __future__ import annotations

import http.client
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
CONF = Path(__file__).resolve().parents[3] / "deploy" / "nginx.conf"

#: What a hostile upstream reply carries.
HOSTILE = {
    "X-Accel-Redirect": "/internal/secret", "X-Accel-Buffering": "no",
    "X-Sendfile": "/etc/passwd", "NEL": '{"report_to":"x","max_age":1}',
    "Report-To": '{"group":"x"}', "Reporting-Endpoints": 'x="https://evil.example"',
    "Accept-CH": "Sec-CH-UA", "Set-Login": "logged-in", "Origin-Agent-Cluster": "?0",
    "Expect-CT": "max-age=1", "Public-Key-Pins": 'pin-sha256="x"; max-age=1',
    "Alt-Svc": 'h2="evil.example:443"', "Strict-Transport-Security": "max-age=1",
    "Use-As-Dictionary": 'match="/*"', "Sec-Session-Registration": '(ES256);path="/x"',
    "Sec-Session-Challenge": '"c"', "Secure-Session-Registration": '(ES256);path="/x"',
    "Secure-Session-Challenge": '"c"',
    "Activate-Storage-Access": "retry; allowed-origin=*", "No-Vary-Search": "params",
    "Clear-Site-Data": '"cookies", "storage"',
}


class _Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        body = b"upstream says " + self.path.encode()
        self.send_response(200)
        for name, value in HOSTILE.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _test_config(upstream_port: int, port: int, root: Path) -> str:
    """The shipped file, on plain HTTP and loopback ports, with an `internal` location."""
    text = CONF.read_text()
    text = text.replace("server 127.0.0.1:8080;", f"server 127.0.0.1:{upstream_port};")
    text = text.replace("listen 443 ssl;", f"listen 127.0.0.1:{port};")
    text = re.sub(r"\n\s*ssl_certificate\S*\s[^;]*;", "", text)
    internal = root / "internal"
    internal.mkdir()
    (internal / "secret").write_text("INTERNAL CONTENT")
    text = text.replace("    location / {", f"    location /internal/ {{\n        internal;\n"
                        f"        root {root};\n    }}\n\n    location / {{", 1)
    temp = "\n".join(f"    {name}_temp_path {root}/{name};" for name in
                     ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return (f"pid {root}/nginx.pid;\nerror_log {root}/error.log;\nevents {{}}\n"
            f"http {{\n    access_log off;\n{temp}\n{text}\n}}\n")


@pytest.fixture()
def nginx(tmp_path: Path) -> Iterator[int]:
    if NGINX is None:
        pytest.skip("the nginx binary is not installed (Debian package nginx; CI installs it)")
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port = _free_port()
    conf = tmp_path / "nginx.conf"
    conf.write_text(_test_config(upstream.server_address[1], port, tmp_path))
    proc = subprocess.Popen([NGINX, "-p", str(tmp_path), "-c", str(conf), "-g", "daemon off;"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError("nginx did not start: " + proc.stdout.read().decode()
                                     if proc.stdout else "")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
        upstream.shutdown()
        upstream.server_close()


def test_shipped_nginx_ignores_proxy_control_and_hides_origin_wide_headers(nginx: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", nginx, timeout=10)
    try:
        conn.request("GET", "/endpoints/1/x", headers={"Host": "endpoints.example.com"})
        resp = conn.getresponse()
        body = resp.read()
        names = {name.lower() for name, _ in resp.getheaders()}
    finally:
        conn.close()
    assert resp.status == 200
    # nginx did not follow X-Accel-Redirect into the internal location
    assert body == b"upstream says /endpoints/1/x"
    assert not names & {name.lower() for name in HOSTILE}, names


class _DiesMidRequest(BaseHTTPRequestHandler):
    """A node that dies with the request in hand: reads it, closes unanswered."""

    protocol_version = "HTTP/1.1"
    seen: list[str]

    def _die(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self.seen.append(f"{self.command} {self.path}")
        self.close_connection = True

    do_GET = do_POST = do_PATCH = _die  # noqa: N815 - http.server's naming

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def test_shipped_nginx_resends_an_invocation_but_no_other_post_that_reached_a_node(
        tmp_path: Path) -> None:
    """deploy/nginx.conf's failover (docs/deployment.md): a node that closed the
    connection with the request unanswered, as a killed node does, gets the
    request sent to the next node for an invocation (any method) and for a
    GET anywhere, but never for a POST or PATCH to the admin API, dashboard
    or chat command, which may have changed state."""
    if NGINX is None:
        pytest.skip("the nginx binary is not installed (Debian package nginx; CI installs it)")
    seen: list[str] = []
    handler = type("Handler", (_DiesMidRequest,), {"seen": seen})
    nodes = [ThreadingHTTPServer(("127.0.0.1", 0), handler) for _ in range(2)]
    for node in nodes:
        threading.Thread(target=node.serve_forever, daemon=True).start()
    port = _free_port()
    text = CONF.read_text().replace(
        "server 127.0.0.1:8080;",
        # max_fails=0: both stay in use after failing, so every request below
        # meets the two of them.
        " ".join(f"server 127.0.0.1:{node.server_address[1]} max_fails=0;" for node in nodes))
    text = text.replace("listen 443 ssl;", f"listen 127.0.0.1:{port};")
    text = re.sub(r"\n\s*ssl_certificate\S*\s[^;]*;", "", text)
    temp = "\n".join(f"    {name}_temp_path {tmp_path}/{name};" for name in
                     ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    conf = tmp_path / "nginx.conf"
    conf.write_text(f"pid {tmp_path}/nginx.pid;\nerror_log {tmp_path}/error.log;\nevents {{}}\n"
                    f"http {{\n    access_log off;\n{temp}\n{text}\n}}\n")
    proc = subprocess.Popen([NGINX, "-p", str(tmp_path), "-c", str(conf), "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "nginx did not start"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)

        def tries(method: str, path: str) -> list[str]:
            seen.clear()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                conn.request(method, path, body=None if method == "GET" else b"{}",
                             headers={"Host": "endpoints.example.com"})
                resp = conn.getresponse()
                resp.read()
            finally:
                conn.close()
            assert resp.status == 502
            return list(seen)

        assert tries("POST", "/endpoints/1/logic_x") == ["POST /endpoints/1/logic_x"] * 2
        assert tries("GET", "/api/v1/guilds/1") == ["GET /api/v1/guilds/1"] * 2
        for method, path in (("POST", "/api/v1/guilds"), ("PATCH", "/api/v1/guilds/1"),
                             ("POST", "/dashboard/1/scripts"), ("POST", "/interactions")):
            assert tries(method, path) == [f"{method} {path}"]
    finally:
        proc.terminate()
        proc.wait(10)
        for node in nodes:
            node.shutdown()
            node.server_close()
