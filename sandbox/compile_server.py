"""The save-time compile's fork server: compile processes forked from a warm parent.

Starting a fresh interpreter and importing the compiler for each save cost
~0.2 s of CPU (most of a save); a fork of a parent that has imported it all
costs a few milliseconds. The parent ("compile server") is itself a fresh
interpreter (``-I``, empty environment, only the sandbox imported: nothing
of the service's memory), started once per service process on the first
save; it never reads a source and never runs a compile. For each save:

service -> server: one SOCK_SEQPACKET packet ``{"cpu", "mem", "uid", "gid",
                   "nice", "wall"}`` (JSON) with two descriptors: the
                   compile's *data* socket and its *status* socket.
server:            forks a child that closes every other descriptor at once
                   (the control socket, other compiles' sockets), makes the
                   data socket its stdin and stdout and runs
                   ``compile_gate.compile_child``: it reads the source,
                   hardens itself, compiles, writes the verdict, exits.
                   The server closes its copy of the data socket (so the
                   service reads EOF when the child is gone), waits for the
                   child (killing it past ``wall`` seconds) and writes
                   ``{"code", "signal", "wall"}`` to the status socket, which
                   the child never held: a compile process cannot forge how
                   it ended.

The server exits when the control socket closes (the service process is
gone), killing the compiles still running.
"""
from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, NoReturn

MAX_CONTROL = 4096

_BOOTSTRAP = (
    "import json, sys\n"
    "payload = json.loads(sys.argv[1])\n"
    "sys.path[:] = payload['path']\n"
    "from sandbox import compile_server\n"
    "compile_server.main(int(sys.argv[2]), payload)\n"
)


class ServerGone(Exception):
    """The compile server could not be started or reached."""


class Client:
    """The service's side: starts the server on first use, once per process."""

    def __init__(self, max_running: int = 0) -> None:
        self.max_running = max_running or MAX_RUNNING
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._ctl: socket.socket | None = None
        #: Servers told to retire, with the time by which they must have exited:
        #: they finish their compiles, then exit (or are killed past it).
        self._retired: list[tuple[subprocess.Popen[bytes], float]] = []
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        # A forked process starts its own server: it must not keep the
        # parent's alive (its copy of the control socket) nor inherit a lock
        # another thread held at the fork.
        self._lock = threading.Lock()
        if self._ctl is not None:
            self._ctl.close()
        self._ctl, self._proc, self._retired = None, None, []

    def _prune(self) -> None:
        now, kept = time.monotonic(), []
        for proc, deadline in self._retired:
            if proc.poll() is not None:
                continue
            if now > deadline:   # wedged: its compiles are past every limit
                proc.kill()
                proc.wait()
                continue
            kept.append((proc, deadline))
        self._retired = kept

    def _start(self) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        payload = json.dumps({"path": [p for p in sys.path if isinstance(p, str)],
                              "max_running": self.max_running})
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOTSTRAP, payload, str(theirs.fileno())],
                env={}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), close_fds=True)
        except OSError as exc:
            ours.close()
            raise ServerGone(f"compile process could not start: {exc.strerror}") from exc
        finally:
            theirs.close()
        self._ctl = ours
        return ours

    def request(self, params: dict[str, Any], data_fd: int,
                status_fd: int) -> subprocess.Popen[bytes] | None:
        """Ask the server to fork a compile on these sockets (starting it if needed);
        returns the server asked (for `restart`)."""
        message = json.dumps(params).encode()
        with self._lock:
            self._prune()
            for attempt in (1, 2):
                ctl = self._ctl if self._ctl is not None else self._start()
                try:
                    socket.send_fds(ctl, [message], [data_fd, status_fd])
                    return self._proc
                except OSError as exc:
                    self._stop()
                    if attempt == 2:
                        raise ServerGone(f"compile process could not start: "
                                         f"{exc.strerror}") from exc
        raise AssertionError("unreachable")

    def restart(self, server: subprocess.Popen[bytes] | None) -> None:
        """Stop ``server`` (it did not answer in time), the current one or a
        retired one: its compiles end with it (they die with their parent); a
        request after the current one's stop starts another."""
        with self._lock:
            if server is not None and server is self._proc:
                self._stop()
            elif server is not None and server.poll() is None:
                server.kill()
                server.wait()

    def retire(self, grace_s: float) -> None:
        """Let the server finish the compiles it runs and exit, within ``grace_s``
        (or be killed); the next request starts another (a fresh interpreter:
        new addresses, new stack canary)."""
        with self._lock:
            if self._ctl is None or self._proc is None:
                return
            try:
                self._ctl.send(b'{"retire": true}')
            except OSError:
                self._stop()
                return
            self._ctl.close()
            self._retired.append((self._proc, time.monotonic() + grace_s))
            self._ctl, self._proc = None, None

    def _stop(self) -> None:
        if self._ctl is not None:
            self._ctl.close()
        self._ctl = None
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None


# --- the server ---------------------------------------------------------------

#: Compiles one server runs at once; a save past it is answered "busy".
MAX_RUNNING = 64


class _Compile:
    __slots__ = ("pid", "status", "deadline", "pidfd", "killed")

    def __init__(self, pid: int, status: socket.socket, deadline: float, pidfd: int) -> None:
        self.pid, self.status, self.deadline, self.pidfd = pid, status, deadline, pidfd
        self.killed = False


def main(ctl_fd: int, payload: dict[str, Any]) -> NoReturn:
    """Entry point of the exec'd server (see _BOOTSTRAP)."""
    try:
        # Everything a compile needs, imported once: after the uid drop and
        # Landlock a compile process can open no file.
        from sandbox import (checks, compile_gate, compiler, hardening, landlock, limits,
                             seccomp_rules)
        del checks, compiler, hardening, landlock, limits, seccomp_rules
        gc.collect()
        gc.freeze()   # the imports' pages stay shared with every compile
        _serve(socket.socket(fileno=ctl_fd), compile_gate.compile_child,
               int(payload["max_running"]))
    finally:
        os._exit(0)


def _serve(ctl: socket.socket, compile_child: Any, max_running: int) -> None:
    running: dict[int, _Compile] = {}
    watch = selectors.DefaultSelector()   # epoll: no limit on descriptor numbers
    watch.register(ctl, selectors.EVENT_READ)
    accepting = True
    try:
        while accepting or running:
            now = time.monotonic()
            wait = min((c.deadline for c in running.values()), default=now + 1.0) - now
            for key, _ in watch.select(max(0.0, min(wait, 1.0))):
                if key.fileobj is ctl:
                    accepting = _accept(ctl, running, watch, compile_child, max_running)
                    if not accepting:
                        watch.unregister(ctl)
            _reap(running, watch)
    finally:
        for job in running.values():
            _kill(job.pid)
        while running:
            _reap(running, watch, block=True)


def _accept(ctl: socket.socket, running: dict[int, _Compile], watch: selectors.BaseSelector,
            compile_child: Any, max_running: int) -> bool:
    """Take one request; False when there will be no more (retire, or the service is gone:
    with the latter the caller's ``finally`` ends the running compiles)."""
    try:
        message, fds, _, _ = socket.recv_fds(ctl, MAX_CONTROL, 2)
    except OSError:
        raise SystemExit(0) from None
    if not message:
        for fd in fds:
            os.close(fd)
        raise SystemExit(0)   # the service closed its end: it is gone
    if len(fds) != 2:
        for fd in fds:
            os.close(fd)
        return not message.startswith(b'{"retire"')
    data, status = fds
    if len(running) >= max_running:
        os.close(data)
        with socket.socket(fileno=status) as busy:
            busy.sendall(b'{"busy": true}')
        return True
    try:
        params = json.loads(message)
        pid = os.fork()
    except (OSError, ValueError):
        os.close(data)    # the service reads no answer and no status: a failed
        os.close(status)  # compile, not remembered, and it may try again
        return True
    if pid == 0:  # pragma: no cover - runs in the compile process
        try:
            os.dup2(data, 0)
            os.dup2(data, 1)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))   # nothing of the others
            running.clear()                               # nor their pids and times
            compile_child(params)
        finally:
            os._exit(70)
    os.close(data)
    try:
        pidfd = os.pidfd_open(pid)
        watch.register(pidfd, selectors.EVENT_READ)
    except (AttributeError, OSError):
        pidfd = -1   # an old kernel: the loop's timeout polls instead
    running[pid] = _Compile(pid, socket.socket(fileno=status), time.monotonic()
                            + float(params["wall"]), pidfd)
    return True


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(running: dict[int, _Compile], watch: selectors.BaseSelector,
          block: bool = False) -> None:
    now = time.monotonic()
    for job in list(running.values()):
        if not job.killed and now >= job.deadline:
            _kill(job.pid)
            job.killed = True
        pid, raw = os.waitpid(job.pid, 0 if block else os.WNOHANG)
        if pid == 0:
            continue
        del running[job.pid]
        if job.pidfd >= 0:
            watch.unregister(job.pidfd)
            os.close(job.pidfd)
        code = os.waitstatus_to_exitcode(raw)
        answer = {"code": max(code, 0), "signal": max(-code, 0), "wall": job.killed}
        try:
            job.status.sendall(json.dumps(answer).encode())
        except OSError:
            pass   # the service stopped waiting
        job.status.close()
