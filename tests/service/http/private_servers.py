"""Private Redis and PostgreSQL servers that an outage test may stop and start.

Never the machine's shared servers (other people's tests use them): each of
these runs on a free loopback port, in a temporary directory, and is stopped
by the test that started it.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.service.http.harness import wait_until


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def unread_bytes_on(port: int) -> int:
    """Bytes waiting, unread, in the sockets a server on `port` accepted (/proc/net/tcp)."""
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, queues = fields[1], fields[3], fields[4]
            if int(local.rsplit(":", 1)[1], 16) == port and state == "01":  # ESTABLISHED
                total += int(queues.split(":")[1], 16)
    return total


class PrivateRedis:
    """`redis-server` on a free port, no persistence."""

    def __init__(self) -> None:
        self.binary = shutil.which("redis-server")
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        assert self.binary is not None
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_until(self.ping, 10):
            raise RuntimeError("the private redis-server did not start")
        return self

    def client(self) -> Any:
        import redis
        return redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=2)

    def ping(self) -> bool:
        try:
            return bool(self.client().ping())
        except Exception:  # noqa: BLE001
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # in case a test froze it
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


def _pg_bin() -> str | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if found:
        return str(Path(found[-1]).parent)
    pg_ctl = shutil.which("pg_ctl")
    return str(Path(pg_ctl).parent) if pg_ctl else None


class PrivatePostgres:
    """A PostgreSQL cluster of its own: `initdb` into `root`, `pg_ctl` on a free port.

    As root, the server runs as the `postgres` user (it refuses root), via runuser.
    """

    def __init__(self) -> None:
        self.bin = _pg_bin()
        # Its own directory under /tmp: pytest's temporary tree is private to
        # root, and the server may run as another user.
        self.root = Path(tempfile.mkdtemp(prefix="logic-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.user: str | None = None
        #: More server options for `pg_ctl -o` (e.g. "-c max_connections=8").
        self.options = ""
        self._started = False   # once started, its port is in URLs: it keeps it
        if os.geteuid() == 0:
            self.user = "postgres"

    def missing(self) -> str | None:
        """Why this cannot run here, or None."""
        if self.bin is None:
            return "PostgreSQL server binaries (initdb, pg_ctl) are not installed"
        if self.user is not None:
            try:
                pwd.getpwnam(self.user)
            except KeyError:
                return "running as root and there is no 'postgres' user to run a private server"
            if shutil.which("runuser") is None:
                return "running as root and runuser is missing"
        return None

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        cmd = list(args)
        if self.user is not None:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

    def init(self) -> PrivatePostgres:
        assert self.bin is not None
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._run(f"{self.bin}/initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust",
                  "--no-sync", "-E", "UTF8")
        return self

    def start(self) -> None:
        """Start the server; on its first start, on another free port if its port
        was taken meanwhile (by any socket, a client's own end included)."""
        for attempt in range(3):
            try:
                self._run(f"{self.bin}/pg_ctl", "-D", str(self.data), "-w", "-t", "60",
                          "-l", str(self.root / "server.log"),
                          "-o", f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} "
                                f"-c fsync=off -c full_page_writes=off {self.options}", "start")
            except subprocess.CalledProcessError as err:
                log = self.log()
                if self._started or attempt == 2 or "could not bind" not in log:
                    raise RuntimeError(f"pg_ctl start failed ({err.returncode}); server log:\n"
                                       f"{log[-2000:]}") from None
                self.port = free_port()
                continue
            self._started = True
            return

    def log(self) -> str:
        try:
            return (self.root / "server.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, mode: str = "fast") -> None:
        self._run(f"{self.bin}/pg_ctl", "-D", str(self.data), "-w", "-t", "60", "-m", mode, "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def _processes(self) -> list[int]:
        """The postmaster and its children (backends, background workers)."""
        main = int((self.data / "postmaster.pid").read_text().split()[0])
        with open(f"/proc/{main}/task/{main}/children") as fh:
            return [main, *(int(p) for p in fh.read().split())]

    def pause(self) -> None:
        """Stop every process of the server (SIGSTOP): connections stay open,
        nothing answers — a stalled server, proxy or network."""
        for pid in self._processes():
            os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in self._processes():
            os.kill(pid, signal.SIGCONT)

    def cleanup(self) -> None:
        if self.running():
            try:
                self.stop("immediate")
            except subprocess.SubprocessError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


def poll(predicate: Callable[[], Any], timeout: float = 20.0) -> bool:
    """`wait_until` with the longer deadline outage tests need on a loaded machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def dependency_down(server: Any, dependency: str) -> float | None:
    """`logic_dependency_down{dependency=...}` from the server's `GET /metrics`."""
    from prometheus_client.parser import text_string_to_metric_families
    text = server.request("/metrics", method="GET").body.decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (sample.name == "logic_dependency_down"
                    and sample.labels.get("dependency") == dependency):
                return float(sample.value)
    return None


class StallingProxy:
    """A TCP proxy on a free loopback port to `host:port`. `stall()`: every
    connection, open or new, stays open and nothing more is forwarded either
    way (a stalled pooler, proxy or network; a close is still passed on);
    `close()` ends it all."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.stalled = False
        self._closed = False
        self._socks: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def stall(self) -> None:
        self.stalled = True

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._socks.append(client)
            if self.stalled:
                continue   # accepted, never answered
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            self._socks.append(upstream)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                while self.stalled and not self._closed:
                    time.sleep(0.05)
                dst.sendall(data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for sock in self._socks:
            try:
                sock.close()
            except OSError:
                pass
