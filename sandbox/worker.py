"""The worker process: harden itself, then serve jobs from its channel.

A worker is forked by the fork server (``sandbox.zygote``), hardens itself
(``sandbox.hardening``), reports which layers took effect, then loops: receive
a message, hand it to its ``sandbox.job_runner.JobRunner`` (a job, or for the
pool's compile worker a ``compile``: it never runs a script, and the pool
sends it the sources of one guild only, ``sandbox.compiling``), send the
reply, and exit when the reply says so.  It never decides about time: the
supervisor SIGKILLs it past the deadline.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any, NoReturn

from sandbox import hardening, limits, protocol
from sandbox.errors import ProtocolError
from sandbox.job_runner import JobRunner, error_result

EXIT_EOF = 0
EXIT_PROTOCOL = 65
EXIT_HOOK_REFUSED = 66


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs, fixed when the pool is built."""

    hardening: hardening.HardeningConfig
    compile_cache: int = 64
    prefer_memguard: bool = True
    test_hooks: bool = False
    spin_us: int = 0
    #: Resident bytes a worker may keep beyond its start-up size; it retires past
    #: them (0: ``limits.MAX_RSS_GROWTH_BYTES``).
    max_rss_growth: int = 0


def _test_exec(code: str) -> tuple[bool, Any]:
    """TEST HOOK: unrestricted exec inside a hardened worker (pool must enable it)."""
    ns: dict[str, Any] = {}
    try:
        exec(compile(code, "<test-hook>", "exec"), ns)  # noqa: S102 - test-only, see docstring
    except BaseException as exc:
        return False, f"{type(exc).__name__}: {exc}"
    value = ns.get("result")
    try:
        protocol.encode({"v": value}, protocol.MAX_REPLY_BYTES)
    except ProtocolError:
        value = repr(value)
    return True, value


def _send(sock: socket.socket, message: dict[str, Any]) -> dict[str, Any]:
    """Send one message; returns what was actually sent."""
    try:
        frame = protocol.encode(message, protocol.MAX_REPLY_BYTES)
    except ProtocolError:
        if "code" in message and message.get("t") == "compiled":
            # The offered code is too large to send: "compiled" without it.
            return _send(sock, {"t": "compiled", "id": message["id"]})
        if message.get("t") != "res":
            raise
        # Too large or not encodable: the script's reply was invalid.
        message = {**message, "exit": True,
                   "r": error_result("invalid_reply", "script reply is too large to return")}
        frame = protocol.encode(message, protocol.MAX_REPLY_BYTES)
    sock.sendall(frame)
    return message


def _spin_until_readable(sock: socket.socket, spin_s: float) -> None:
    """Poll briefly (yielding the CPU) before blocking in recv.

    A sleeping worker on another core can take ~100 us to wake on some
    virtual machines; when the next job comes within the spin it is picked up
    at once.  Off by default: it costs up to ``spin_s`` of CPU per job.
    """
    end = time.perf_counter() + spin_s
    peek = socket.MSG_PEEK | socket.MSG_DONTWAIT
    while time.perf_counter() < end:
        try:
            sock.recv(1, peek)
            return
        except BlockingIOError:
            os.sched_yield()


def serve(channel_fd: int, cfg: WorkerConfig, seccomp_filter: Any,
          shared_netns: tuple[bool, str] | None = None, forked_at: float = 0.0,
          root_fd: int = -1) -> NoReturn:
    """Worker entry point after fork; never returns.

    ``shared_netns``: the fork server's network namespace result (see
    ``hardening.share_network_namespace``); ``forked_at``: its
    ``perf_counter()`` just before the fork, so the ready message can say
    what each start-up step cost (``ms``: fork, harden, init); ``root_fd``:
    the empty directory to ``chroot`` into (``hardening.make_empty_root``).
    """
    try:
        t_child = time.perf_counter()
        fd, report = hardening.harden(channel_fd, cfg.hardening, seccomp_filter, shared_netns,
                                      root_fd)
        t_hard = time.perf_counter()
        sock = socket.socket(fileno=fd)
        sock.setblocking(True)
        accountant = limits.make_accountant(cfg.prefer_memguard)
        report.set("memguard", accountant.enforcing,
                   "tracemalloc in use (extension not built or disabled): memory is "
                   "judged after the run; RLIMIT_AS alone stops a growing loop")
        runner = JobRunner(cfg, accountant)
        runner.on_compiled = lambda job_id, offer: _send(
            sock, {"t": "compiled", "id": job_id} if offer is None
            else {"t": "compiled", "id": job_id, "code": offer[0], "meta": offer[1]})
        runner.send_where = lambda message: _send(sock, message)
        signal.signal(signal.SIGALRM, runner.on_time_limit)
        t_init = time.perf_counter()
        steps = {"fork": max(t_child - forked_at, 0.0) * 1000.0 if forked_at else 0.0,
                 "harden": (t_hard - t_child) * 1000.0, "init": (t_init - t_hard) * 1000.0}
        _send(sock, {"t": "ready", "pid": os.getpid(), "hard": report.layers,
                     "notes": report.notes, "ms": steps})
        waiting = select.poll()
        waiting.register(fd, select.POLLIN)
        while True:
            if cfg.spin_us:
                _spin_until_readable(sock, cfg.spin_us / 1e6)
            # Wait in poll(), not in a blocking recv(): the service reading our
            # reply frees our socket's send space, and that wakes a task
            # blocked in recv() (for nothing) but not one in poll(POLLIN).
            waiting.poll()
            try:
                msg = protocol.check_job(protocol.recv_message(sock, protocol.MAX_JOB_BYTES,
                                                               runner.before_frame))
            except EOFError:
                os._exit(EXIT_EOF)
            if msg["t"] == "exec":
                if not cfg.test_hooks:
                    os._exit(EXIT_HOOK_REFUSED)
                runner.release_limits()
                ok, value = _test_exec(msg["code"])
                _send(sock, {"t": "xres", "id": msg["id"], "ok": ok, "value": value})
                continue
            if msg["t"] == "compile":
                sent = _send(sock, runner.compile_only(msg))
            else:
                sent = _send(sock, runner.handle(msg))
            if sent.get("exit"):
                os._exit(EXIT_EOF)
    except ProtocolError:
        os._exit(EXIT_PROTOCOL)
    except BaseException:
        os._exit(70)
