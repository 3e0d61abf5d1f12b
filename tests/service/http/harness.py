"""A real `logic serve` process on loopback, and a raw HTTP client to talk to it."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOGIC = str(Path(sys.executable).parent / "logic")


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes
    raw_headers: list[tuple[str, str]] = field(default_factory=list)

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def code(self) -> str | None:
        try:
            return self.json["error"]["code"]  # type: ignore[no-any-return]
        except (ValueError, KeyError, TypeError):
            return None


@dataclass
class Server:
    """A `logic serve` subprocess; its log lines are collected for inspection."""

    database_url: str
    config: str | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    proc: subprocess.Popen[str] | None = None
    log_lines: list[str] = field(default_factory=list)
    #: A descriptor limit (soft and hard) for the server process, if set.
    nofile: int | None = None
    #: The address `logic serve` listens on (`::1` for IPv6 tests).
    host: str = "127.0.0.1"

    def start(self, timeout: float = 20.0) -> Server:
        args = [LOGIC, "--database-url", self.database_url]
        if self.config:
            args += ["--config", self.config]
        args += ["serve", "--host", self.host, "--port", "0", *self.extra_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        limit = self.nofile

        def limit_descriptors() -> None:
            if limit is not None:
                import resource
                resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env,
                                     preexec_fn=limit_descriptors if limit is not None else None)
        ready = threading.Event()

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log_lines.append(line)
                match = re.search(r"listening on http://\S*:(\d+) ", line)
                if match and not ready.is_set():
                    self.port = int(match.group(1))
                    ready.set()
            ready.set()

        self.pump = threading.Thread(target=pump, daemon=True)
        self.pump.start()
        if not ready.wait(timeout) or not self.port:
            self.kill()
            raise RuntimeError("logic serve did not start:\n" + "".join(self.log_lines))
        return self

    @property
    def log(self) -> str:
        return "".join(self.log_lines)

    def url(self, guild_id: str, script_id: str) -> str:
        return f"/endpoints/{guild_id}/{script_id}"

    def request(
        self,
        path: str,
        *,
        method: str = "POST",
        body: bytes | str | None = None,
        json_body: Any = None,
        secret: str | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 10.0,
        source_ip: str | None = None,
    ) -> Response:
        hdrs = dict(headers or {})
        if secret is not None:
            hdrs.setdefault("Authorization", f"Bearer {secret}")
        if json_body is not None:
            body = json.dumps(json_body)
            hdrs.setdefault("Content-Type", "application/json")
        conn = http.client.HTTPConnection(
            "127.0.0.1", self.port, timeout=timeout,
            source_address=(source_ip, 0) if source_ip else None)
        try:
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            raw = resp.getheaders()
            return Response(resp.status, {k.lower(): v for k, v in raw}, resp.read(), raw)
        finally:
            conn.close()

    def request_from(self, ip: str, path: str, **kwargs: Any) -> Response:
        """The same request, sent from another loopback address (127.0.0.0/8)."""
        return self.request(path, source_ip=ip, **kwargs)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        finally:
            self._close_pipe()

    def _close_pipe(self) -> None:
        if self.proc is not None and self.proc.stdout is not None and self.proc.poll() is not None:
            self.pump.join(5)
            self.proc.stdout.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._close_pipe()


def connection_refused(port: int, timeout: float = 5.0) -> bool:
    """True when a new connection to 127.0.0.1:`port` is refused (no listener)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=timeout).close()
    except ConnectionRefusedError:
        return True
    return False


def at_once(count: int, call: Any, timeout: float = 60.0) -> list[Any]:
    """`call(n)` for n in range(count), each on its own thread, all released
    together (a barrier): the results, in the order they came back."""
    results: list[Any] = []
    lock = threading.Lock()
    start = threading.Barrier(count)

    def one(n: int) -> None:
        start.wait(10)
        got = call(n)
        with lock:
            results.append(got)

    threads = [threading.Thread(target=one, args=(n,)) for n in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return results


#: PostgreSQL: how long a commit made elsewhere (here: by the test process) may
#: take to reach the node as a change notification; the node's cache is in
#: force until then (docs/architecture.md; tests/service/http/test_nodes.py uses
#: the same bound).
NOTIFY_BOUND_S = 1.0


def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
