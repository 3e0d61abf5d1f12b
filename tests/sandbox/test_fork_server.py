"""The fork server's reaping: a worker the service names as ending is waited for
by its pid (a walk of every child costs as much as there are workers, thousands
with one worker per active guild); any other child that exits is still reaped,
by a walk at most once a second. Real fork server, real hardened workers."""
from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack  # type: ignore[import-untyped]

from sandbox import zygote
from sandbox.pool import Pool
from sandbox.worker import WorkerConfig
from tests.sandbox.poolkit import alive


@contextmanager
def _fork_server() -> Iterator[tuple[int, socket.socket]]:
    """A fork server started as the pool starts it, and its control socket."""
    cfg = WorkerConfig(Pool(size=1)._hcfg)
    pid, ctl = zygote.start(cfg)
    try:
        yield pid, ctl
    finally:
        ctl.close()         # the fork server kills its workers and exits
        os.waitpid(pid, 0)


def _next(ctl: socket.socket, kind: str, timeout: float = 30.0) -> tuple[dict[str, Any], list[int]]:
    """The next control message of type ``kind`` (others, with their descriptors, dropped)."""
    end = time.monotonic() + timeout
    while True:
        ctl.settimeout(max(0.01, end - time.monotonic()))
        data, fds, _, _ = socket.recv_fds(ctl, 4096, 2)
        msg = msgpack.unpackb(data, raw=False)
        if msg.get("t") == kind:
            return msg, fds
        for fd in fds:
            os.close(fd)


def _spawn(ctl: socket.socket) -> tuple[int, int, int]:
    """(pid, channel, pidfd) of a new worker."""
    ctl.send(msgpack.packb({"t": "spawn", "slot": 0}))
    msg, fds = _next(ctl, "spawned")
    assert len(fds) == 2, "this kernel gives pidfds"
    return msg["pid"], fds[0], fds[1]


def test_a_worker_named_as_ending_is_reaped_by_its_pid() -> None:
    with _fork_server() as (_, ctl):
        for _ in range(5):
            pid, channel, pidfd = _spawn(ctl)
            # As the pool does when it retires or replaces a worker: kill, name it.
            # (Named first here, so that the test never races the once-a-second walk.)
            ctl.send(msgpack.packb({"t": "reap", "pids": [pid]}))
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            msg, _ = _next(ctl, "exit")
            assert (msg["pid"], msg["signal"], msg["walked"]) == (pid, signal.SIGKILL, False)
            assert not alive(pid) and not os.path.exists(f"/proc/{pid}")   # no zombie left
            os.close(channel)
            os.close(pidfd)


def test_a_worker_that_ends_unnamed_is_still_reaped() -> None:
    with _fork_server() as (_, ctl):
        pid, channel, pidfd = _spawn(ctl)
        ctl.send(msgpack.packb({"t": "reap", "pids": pid}))       # malformed: ignored
        ctl.send(msgpack.packb({"t": "reap", "pids": [[pid]]}))   # malformed: ignored
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        msg, _ = _next(ctl, "exit", timeout=10.0)
        assert (msg["pid"], msg["signal"], msg["walked"]) == (pid, signal.SIGKILL, True)
        assert not os.path.exists(f"/proc/{pid}")
        os.close(channel)
        os.close(pidfd)


def test_a_burst_of_kills_is_named_in_a_few_messages() -> None:
    # The control socket's queue holds a few hundred messages, and spawn
    # requests need it too: a message per killed worker made a burst of
    # retirements crowd out the spawns that replace them (outside review).
    import asyncio

    from sandbox.supervisor import REAP_NAMES

    pool = Pool(size=1)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pool._ctl, pool._zygote_pid = ours, 1      # as if started (no fork server needed)

    async def burst() -> None:
        pool._loop = asyncio.get_running_loop()
        for pid in range(1000, 2000):           # e.g. the memory budget retiring 1,000
            pool._reap(pid)
        await asyncio.sleep(0)                  # the loop's next turn sends the names

    try:
        asyncio.run(burst())
        theirs.setblocking(False)
        named: list[int] = []
        messages = 0
        while True:
            try:
                msg = msgpack.unpackb(theirs.recv(zygote.MAX_CONTROL), raw=False)
            except BlockingIOError:
                break
            messages += 1
            assert msg["t"] == "reap"
            named += msg["pids"]
        assert named == list(range(1000, 2000))
        assert messages == -(-1000 // REAP_NAMES)
        assert len(msgpack.packb({"t": "reap", "pids": [4194304] * REAP_NAMES})) \
            <= zygote.MAX_CONTROL
    finally:
        ours.close()
        theirs.close()
