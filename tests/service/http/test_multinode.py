"""Two `logic serve` nodes behind nginx on one PostgreSQL and one Redis: the
stack of deploy/compose.yaml, without a container runtime.

nginx is Debian's binary running the shipped deploy/nginx.conf (plain HTTP on
loopback, its upstream pointed at the two nodes); the nodes share the test
PostgreSQL schema and the local Redis (db 15) for their rate-limit windows.
Checked through nginx, as a client sees it:
- the rate limit is exact across the nodes (Redis);
- a rotated secret is in force on both nodes (PostgreSQL LISTEN/NOTIFY),
  directly and through nginx;
- a node stopped under load (SIGTERM, or SIGKILL) loses no request: nginx
  sends what the stopped node did not answer to the other one
  (docs/deployment.md, "nginx in front of several nodes").
"""
from __future__ import annotations

import http.client
import itertools
import json
import random
import re
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.service.http.conftest import OWNER, Ep, Env
from tests.service.http.harness import Server, connection_refused, wait_until
from tests.service.http.test_nginx import CONF, NGINX, _free_port
from tests.service.http.test_ratelimit import _redis_url

pytestmark = pytest.mark.parametrize("http_env", ["postgresql"], indirect=True)

SOURCE = "on endpoint(event):\n    event.reply({'ok': True, 'n': event.body.get('n')})\n"
#: The stated bound for a change to reach every node (docs/architecture.md).
BOUND_S = 1.0

# Client addresses unique to this run: the failed-secret throttle counts per
# IP in the shared Redis, where other runs and other tests count theirs too.
_RUN = random.randrange(100, 250)
_ips = itertools.count(1)


def fresh_ip() -> str:
    n = next(_ips)
    return f"127.{_RUN}.{n // 250}.{n % 250 + 2}"


@dataclass
class Nginx:
    port: int
    access_log: Path
    proc: subprocess.Popen[bytes]
    upstreams: tuple[int, int]

    def request(self, path: str, secret: str, body: object, source_ip: str | None = None,
                conn: http.client.HTTPConnection | None = None) -> tuple[int, bytes]:
        own = conn is None
        if conn is None:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30,
                                              source_address=(source_ip or fresh_ip(), 0))
        try:
            conn.request("POST", path, body=json.dumps(body),
                         headers={"Authorization": f"Bearer {secret}",
                                  "Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            if own:
                conn.close()

    def served_by(self) -> Counter[int]:
        """How many requests each upstream port answered (the last one tried)."""
        ports: Counter[int] = Counter()
        for line in self.access_log.read_text().splitlines():
            addrs = re.findall(r"127\.0\.0\.1:(\d+)", line)
            if addrs:
                ports[int(addrs[-1])] += 1
        return ports


def nginx_config(upstreams: tuple[int, int], port: int, root: Path) -> str:
    """The shipped file on plain HTTP and loopback, its upstream the two nodes."""
    text = CONF.read_text()
    assert "server 127.0.0.1:8080;" in text
    text = text.replace("server 127.0.0.1:8080;",
                        "\n    ".join(f"server 127.0.0.1:{p};" for p in upstreams))
    text = text.replace("listen 443 ssl;", f"listen 127.0.0.1:{port};")
    text = re.sub(r"\n\s*ssl_certificate\S*\s[^;]*;", "", text)
    # Which node answered: the access log in a format of this test's own.
    assert "access_log /var/log/nginx/access.log logic_redacted;" in text
    text = text.replace("access_log /var/log/nginx/access.log logic_redacted;",
                        f"access_log {root}/access.log upstreams;")
    text = text.replace("/var/log/nginx/", f"{root}/")
    temp = "\n".join(f"    {name}_temp_path {root}/{name};" for name in
                     ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return (f"pid {root}/nginx.pid;\nerror_log {root}/error.log;\n"
            f"events {{ worker_connections 1024; }}\n"
            f"http {{\n    log_format upstreams '$status $upstream_addr $upstream_status';\n"
            f"{temp}\n{text}\n}}\n")


def start_nginx(upstreams: tuple[int, int], root: Path) -> Nginx:
    assert NGINX is not None
    port = _free_port()
    conf = root / "nginx.conf"
    conf.write_text(nginx_config(upstreams, port, root))
    proc = subprocess.Popen([NGINX, "-p", str(root), "-c", str(conf), "-g", "daemon off;"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    nginx = Nginx(port, root / "access.log", proc, upstreams)

    def up() -> bool:
        assert proc.poll() is None, "nginx did not start: " + (root / "error.log").read_text()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return False
        return True

    assert wait_until(up, timeout=10)
    return nginx


@dataclass
class Stack:
    env: Env
    a: Server
    b: Server
    nginx: Nginx
    root: Path
    started: list[Server] = field(default_factory=list)


@pytest.fixture()
def stack(http_env: Env, make_server: Callable[..., Server], tmp_path: Path) -> Iterator[Stack]:
    if NGINX is None:
        pytest.skip("the nginx binary is not installed (Debian package nginx; CI installs it)")
    redis_url = _redis_url()  # skips, saying why, when Redis cannot be reached
    extra = f'[ratelimit]\nstorage = "{redis_url}"\n'
    # A long queue timeout: a load on a busy 2-core machine must never see
    # 503 busy, so that every status below is the one the stack decides.
    a, b = (make_server(trusted_proxies=["127.0.0.1/32"], queue_timeout_ms=20000, extra=extra)
            for _ in range(2))
    nginx = start_nginx((a.port, b.port), tmp_path)
    try:
        yield Stack(http_env, a, b, nginx, tmp_path)
    finally:
        nginx.proc.terminate()
        nginx.proc.wait(10)
        if nginx.proc.stdout is not None:
            nginx.proc.stdout.close()


@pytest.fixture()
def unique_endpoint_ids(http_env: Env) -> None:
    """Endpoint ids this run alone uses: the nodes' windows in the shared Redis
    are keyed by endpoint id, and a fresh schema starts counting at 1 in every
    run (a rerun within a minute would find the last run's hits)."""
    http_env.db.execute_sql("SELECT setval(pg_get_serial_sequence('endpoint', 'id'), %s)",
                            (random.randrange(10**8, 2 * 10**9),))


def direct(srv: Server, ep: Ep, secret: str) -> int:
    return srv.request(ep.path, secret=secret, json_body={}, source_ip=fresh_ip()).status


def test_the_rate_limit_is_exact_across_nodes(
        stack: Stack, unique_endpoint_ids: None, make_endpoint: Callable[..., Ep]) -> None:
    ep = make_endpoint(SOURCE, plan="plus")  # 30 requests per minute
    client = fresh_ip()
    start = threading.Barrier(100)

    def one(n: int) -> tuple[int, bytes]:
        start.wait(30)
        return stack.nginx.request(ep.path, ep.secret, {"n": n}, source_ip=client)

    with ThreadPoolExecutor(100) as pool:
        results = list(pool.map(one, range(100)))
    statuses = Counter(status for status, _ in results)
    assert statuses == {200: 30, 429: 70}
    assert all(json.loads(body)["error"]["code"] == "rate_limited"
               for status, body in results if status == 429)
    served = stack.nginx.served_by()
    assert served[stack.a.port] > 0 and served[stack.b.port] > 0, served


def test_a_rotated_secret_is_in_force_on_both_nodes_and_through_nginx(
        stack: Stack, make_endpoint: Callable[..., Ep], regenerate: Callable[[Ep], str]) -> None:
    ep = make_endpoint(SOURCE, plan="bench")
    a, b, nginx = stack.a, stack.b, stack.nginx

    def everywhere(secret: str) -> tuple[int, ...]:
        # Four through nginx: round robin sends two to each node.
        return (direct(a, ep, secret), direct(b, ep, secret),
                *(nginx.request(ep.path, secret, {})[0] for _ in range(4)))

    def in_force(secret: str, expected: int) -> None:
        """Every way in answers `expected` to requests sent once the bound
        has passed since the commit (just before this call), and keeps doing so."""
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline and set(everywhere(secret)) != {expected}:
            time.sleep(0.002)
        # Sent after the bound even when the ones above were slow (argon2
        # for each wrong secret on a loaded machine).
        for _ in range(3):
            got = everywhere(secret)
            assert set(got) == {expected}, got

    in_force(ep.secret, 200)                          # both nodes' caches warm
    for _ in range(3):
        old, ep.secret = ep.secret, regenerate(ep)    # the service layer, as the CLI does
        in_force(old, 401)
        in_force(ep.secret, 200)
    served = nginx.served_by()
    assert served[a.port] > 0 and served[b.port] > 0, served


class Load:
    """Clients sending requests through nginx until stopped; every answer kept."""

    def __init__(self, nginx: Nginx, ep: Ep, clients: int = 4) -> None:
        self.nginx, self.ep = nginx, ep
        self.statuses: Counter[int] = Counter()
        self.failures: list[str] = []
        self.sent = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True)
                         for _ in range(clients)]
        for thread in self._threads:
            thread.start()

    def _client(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.nginx.port, timeout=60,
                                          source_address=(fresh_ip(), 0))
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                status, body = self.nginx.request(self.ep.path, self.ep.secret, {"n": n}, conn=conn)
                if status == 200 and json.loads(body) != {"ok": True, "n": n}:
                    raise AssertionError(f"wrong answer {body!r}")
            except Exception as err:  # noqa: BLE001 - kept and asserted on below
                conn.close()
                with self._lock:
                    self.failures.append(repr(err))
                continue
            with self._lock:
                self.sent += 1
                self.statuses[status] += 1
        conn.close()

    def count(self) -> int:
        with self._lock:
            return self.sent

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)


def _stop_one_node_under_load(stack: Stack, ep: Ep, stop: Callable[[Server], int],
                              exit_code: int) -> Load:
    a, b = stack.a, stack.b
    load = Load(stack.nginx, ep)
    try:
        # Both nodes are in use before one goes away.
        assert wait_until(lambda: min(stack.nginx.served_by()[p] for p in (a.port, b.port)) >= 20,
                          timeout=30)
        code = stop(a)
        before = load.count()
        # The load goes on after the node is gone (nginx finds it refusing).
        assert wait_until(lambda: load.count() >= before + 200, timeout=60)
    finally:
        load.stop()
    assert code == exit_code
    assert not load.failures, load.failures[:5]
    assert load.statuses == {200: load.sent}
    return load


def test_a_node_stopped_with_sigterm_loses_no_request(
        stack: Stack, make_endpoint: Callable[..., Ep], bind: Callable[[], None]) -> None:
    from service.core import reads
    from service.core.access import Actor

    ep = make_endpoint(SOURCE, plan="bench")    # a million a minute: the load never meets it

    def sigterm(srv: Server) -> int:
        return srv.stop()                       # drains, then exits 0

    load = _stop_one_node_under_load(stack, ep, sigterm, exit_code=0)

    # Each request ran exactly once: nginx re-sent only what the draining
    # node had not taken (its statistics were written when it stopped).
    def total() -> int:
        bind()
        return int(reads.stats(Actor.user(OWNER), ep.guild_id, ep.script_id,
                               plans=stack.env.plans)["total"])

    assert wait_until(lambda: total() >= load.sent, timeout=20)
    assert total() == load.sent


def test_a_node_killed_with_sigkill_loses_no_request(
        stack: Stack, make_endpoint: Callable[..., Ep]) -> None:
    ep = make_endpoint(SOURCE, plan="bench")

    def sigkill(srv: Server) -> int:
        srv.kill()
        assert srv.proc is not None
        return int(srv.proc.returncode)

    _stop_one_node_under_load(stack, ep, sigkill, exit_code=-9)


def test_a_draining_node_closes_a_trusted_proxys_connection_instead_of_answering_503(
        make_server: Callable[..., Server], make_endpoint: Callable[..., Ep]) -> None:
    """What lets nginx send a request to another node during a drain: the
    proxy's kept-alive connection is closed unanswered, while a direct
    client's gets 503 `busy`."""
    srv = make_server(trusted_proxies=["127.0.0.1/32"])
    ep = make_endpoint(SOURCE, plan="bench")
    head = (f"POST {ep.path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ep.secret}\r\n"
            "Content-Type: application/json\r\n")

    def kept_alive(source: str) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10,
                                        source_address=(source, 0))
        sock.sendall(f"{head}Content-Length: 2\r\n\r\n{{}}".encode())
        answer = b""
        while not answer.endswith(b"}"):
            answer += sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 ")
        return sock

    # A request in flight for as long as the test wants: its body is held
    # back once the node said 100 Continue (its headers were accepted).
    held = socket.create_connection(("127.0.0.1", srv.port), timeout=10,
                                    source_address=("127.0.0.3", 0))
    held.sendall(f"{head}Content-Length: 2\r\nExpect: 100-continue\r\n\r\n".encode())
    assert held.recv(65536).startswith(b"HTTP/1.1 100 Continue")
    proxy, client = kept_alive("127.0.0.1"), kept_alive("127.0.0.2")
    # The proxy's next request, its head on the way when the drain begins.
    midway = kept_alive("127.0.0.1")
    midway.sendall(f"{head}Content-Length: 2\r\n".encode())
    time.sleep(0.2)                                     # read by the node: the connection is busy
    try:
        assert srv.proc is not None
        srv.proc.send_signal(15)

        assert wait_until(lambda: connection_refused(srv.port, timeout=1))  # listener closed
        try:
            got = proxy.recv(65536)                     # the proxy's: closed, no answer
        except ConnectionResetError:
            got = b""
        assert got == b""
        midway.sendall(b"\r\n{}")                     # the head completes during the drain
        try:
            got = midway.recv(65536)                    # closed unanswered, not 503
        except ConnectionResetError:
            got = b""
        assert got == b""
        client.sendall(f"{head}Content-Length: 2\r\n\r\n{{}}".encode())
        answer = client.recv(65536)                     # the direct client's: 503 busy
        assert answer.startswith(b"HTTP/1.1 503 ") and b'"busy"' in answer
        assert b"Retry-After: 1" in answer
        held.sendall(b"{}")                             # the request in flight is answered
        assert held.recv(65536).startswith(b"HTTP/1.1 200 ")
    finally:
        for sock in (held, proxy, client, midway):
            sock.close()
    assert srv.proc.wait(30) == 0
