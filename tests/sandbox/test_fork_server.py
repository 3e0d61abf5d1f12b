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


def test_a_spawn_still_queued_when_the_service_closes_ends_every_worker() -> None:
    """The pool closes the control socket when it stops (or aborts its start),
    possibly with spawn requests still queued: the fork server's answer to one
    then finds the socket closed. It must still kill and wait for every worker
    it has, and exit as on any other stop, not die leaving them to the host."""
    cfg = WorkerConfig(Pool(size=1)._hcfg)
    zpid, ctl = zygote.start(cfg)
    try:
        kept, channel, pidfd = _spawn(ctl)      # channel held open: it would live on
        ctl.send(msgpack.packb({"t": "spawn", "slot": 1}))   # queued ...
        ctl.close()                                          # ... as the service goes
        _, status = os.waitpid(zpid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not alive(kept) and not os.path.exists(f"/proc/{kept}")
    finally:
        if not ctl._closed:  # type: ignore[attr-defined]
            ctl.close()
    os.close(channel)
    os.close(pidfd)


def test_a_kill_in_a_closed_loops_last_turn_is_named_when_the_pool_moves_on(caplog) -> None:
    """The names of killed workers go out once per turn of the pool's loop. A
    kill in the last turn of a loop that is then closed (test suites make a
    loop per test) is named as soon as the pool binds to the next loop, not
    with some later kill: meanwhile the walk would reap that worker, and a
    late name could then name a new worker that took its pid. (The fork
    server's once-a-second walk may still come first in the few milliseconds
    between the kill and the name: three tries, where without the name going
    out every try finds it by a walk or never.)"""
    import asyncio
    import logging

    from tests.sandbox.poolkit import ECHO, LIMITS, event, ref

    caplog.set_level(logging.DEBUG, logger="sandbox")

    def exit_line(pid: int) -> str | None:
        return next((r.getMessage() for r in caplog.records
                     if f"worker {pid} exited" in r.getMessage()), None)

    lines = []
    for _ in range(3):
        pool = Pool(size=1, spares=1, max_workers=4, idle_retire_s=3600)
        pool.start()

        async def first(pool: Pool = pool) -> int:
            assert (await pool.run(ref(ECHO), event(), LIMITS, guild="g1")).error_kind is None
            w = next(iter(pool._lru))
            asyncio.get_running_loop().call_soon(pool._retire, w)   # the loop's last turn
            return w.pid

        async def second(pid: int, pool: Pool = pool) -> None:
            try:
                pool.attach()
                deadline = time.monotonic() + 5
                while exit_line(pid) is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
            finally:
                await pool.stop()

        loop = asyncio.new_event_loop()
        try:
            pid = loop.run_until_complete(first())
        finally:
            loop.close()
        asyncio.run(second(pid))
        lines.append(exit_line(pid))
        if lines[-1] is not None and "found by a walk" not in lines[-1]:
            return
    raise AssertionError(f"the killed worker was never named: {lines}")


def test_a_worker_whose_pidfd_did_not_arrive_is_not_used() -> None:
    """At its descriptor limit the service receives a new worker's channel but
    not its pidfd (the kernel drops what it cannot install). Such a worker
    could only be signalled by pid, which another process may hold once the
    worker was reaped: it is not used, and the slot is forked again once
    descriptors are free."""
    import asyncio
    import resource

    from tests.sandbox.poolkit import ECHO, LIMITS, event, ref, run_with_pool

    async def scenario(pool: Pool) -> None:
        assert (await pool.run(ref(ECHO), event(), LIMITS, guild="g1")).error_kind is None
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        probe = os.open(os.devnull, os.O_RDONLY)   # the lowest free descriptor number
        os.close(probe)
        limit = probe + 1   # one free number below it: the channel fits, not the pidfd
        seen_without_pidfd = []
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        try:
            job = asyncio.ensure_future(pool.run(ref(ECHO), event(), LIMITS, guild="g2"))
            end = time.monotonic() + 1.5
            while time.monotonic() < end:
                seen_without_pidfd += [w.pid for w in pool._workers.values()
                                       if w is not None and w.pidfd < 0]
                await asyncio.sleep(0.01)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert seen_without_pidfd == []
        assert (await asyncio.wait_for(job, 30)).error_kind is None
        assert all(w.pidfd >= 0 for w in pool._workers.values() if w is not None)

    run_with_pool(scenario, size=1, spares=1)


_IGNORES_ITS_CHANNEL = '''
import resource, time
hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))   # the backstop is its own to move
while True:          # never reads its channel again: never sees it close
    time.sleep(0.2)
'''
_SERVICE = '''
import asyncio, sys
sys.path[:0] = [ROOT]
from tests.sandbox.poolkit import run_with_pool
async def scenario(pool):
    print("WORKERS", *pool.worker_pids, flush=True)
    await pool._test_exec(HOOK, timeout_ms=60000)
run_with_pool(scenario, size=1, _unsafe_test_hooks=True)
'''


def test_a_worker_that_ignores_its_channel_does_not_outlive_a_killed_service() -> None:
    # Red-team pass, session 34: a taken-over worker that never reads its
    # channel again (standing in: the test hook) slept on as `nobody`,
    # reparented to init, after the service was SIGKILLed (the OOM killer, a
    # crash): its fork server died with the service and killed nobody. Now
    # the fork server is told of the service's death and kills its workers.
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = _SERVICE.replace("ROOT", repr(root)).replace("HOOK", repr(_IGNORES_ITS_CHANNEL))
    service = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert service.stdout is not None
        line = service.stdout.readline()
        assert line.startswith("WORKERS "), line
        workers = [int(pid) for pid in line.split()[1:]]
        time.sleep(1.0)                      # the hook runs: the worker stopped listening
        assert workers and all(alive(pid) for pid in workers)
    finally:
        service.kill()
        service.wait(10)
        service.stdout.close()   # type: ignore[union-attr]
    deadline = time.monotonic() + 5.0
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in workers if alive(pid)]
    for pid in left:                         # do not leave it behind for the next tests
        os.kill(pid, signal.SIGKILL)
    assert not left, "a worker outlived the service"


def test_a_sigterm_to_the_fork_server_while_the_service_lives_leaves_its_workers_serving() -> None:
    # The parent-death signal is SIGTERM now; the same signal from anyone else
    # (an operator's kill) must not end every worker and the requests they
    # run: the fork server ends as before and its workers serve on (review,
    # session 34).
    from tests.sandbox.poolkit import LIMITS, event, ref, run_with_pool, wait_for

    echo = "on endpoint(event):\n    event.reply(event.body)\n"

    async def scenario(pool: Pool) -> tuple[list[int], list[bool], object]:
        first = await pool.run(ref(echo), event({"n": 1}), LIMITS, "g")
        assert first.status == 200, first
        workers = list(pool.worker_pids)
        os.kill(pool._zygote_pid, signal.SIGTERM)
        await wait_for(lambda: not alive(pool._zygote_pid), timeout=10.0)
        again = await pool.run(ref(echo), event({"n": 2}), LIMITS, "g")
        return workers, [alive(pid) for pid in workers], again

    workers, living, again = run_with_pool(scenario, size=1)
    assert workers and all(living), (workers, living)
    assert getattr(again, "body", None) == b'{"n":2}', again
