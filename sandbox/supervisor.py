"""Supervision half of the pool: spawning through the zygote, replacing, stopping.

Kept apart from ``sandbox.pool`` (the public API and the hot path) for size;
:class:`Supervisor` is the base class of ``Pool`` and shares its state; its
clocks (the deadline ticker and housekeeping) are in ``sandbox.ticking``.
Nothing here runs per request: it is the rare path of crashes, replacements
and recycling.
"""
from __future__ import annotations

import asyncio
import logging
import os
import platform
import random
import signal
import socket
import time

import msgpack  # type: ignore[import-untyped]

from sandbox.channel import RequestState, WorkerHandle
from sandbox.errors import SandboxError
from sandbox.cpython_fixes import (BEFORE_3_11_9, DATETIME_STATES_CHECKED, DECIMAL_SIGNALS_HELD,
                                   METHODS_REPLACED, SLOTS_REPLACED, UNICODE_ERRORS_CHECKED)
from sandbox.hardening import EXIT_NO_SECCOMP
from sandbox.limits import MEMGUARD_AVAILABLE, RESTART_COST_S
from sandbox.outcome import Outcome, failure
from sandbox.scheduler import Scheduler
from sandbox.ticking import Ticking

log = logging.getLogger("sandbox.pool")

BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 10.0
REAP_NAMES = 400   # pids per "reap" message (the fork server reads 4,096 bytes at most)


class Supervisor(Ticking):
    """State and supervision methods shared with ``Pool`` (which initialises them;
    the state the clocks use is declared in :class:`Ticking`)."""

    size: int
    max_jobs: int
    max_jobs_jitter: int
    _compile_cache: int
    _test_hooks: bool
    queue_timeout: float
    _hardening: dict[str, bool]
    _notes: dict[str, str]
    _ctl: socket.socket
    _zygote_pid: int
    _ending: list[int]
    _naming: bool
    _state: str
    _busy: int
    _unready: int
    _growers: dict[WorkerHandle, None]

    # provided by Inbox and Pool
    def _on_readable(self, w: WorkerHandle) -> bool:
        raise NotImplementedError

    def _dispatch(self, w: WorkerHandle, req: RequestState) -> None:
        raise NotImplementedError

    def _attach(self) -> asyncio.AbstractEventLoop:
        raise NotImplementedError

    def _unpark(self, w: WorkerHandle) -> None:
        raise NotImplementedError

    def _end(self, req: RequestState, cost_s: float) -> None:
        raise NotImplementedError

    def _pump(self) -> None:
        raise NotImplementedError

    def _unhome(self, req: RequestState) -> None:
        raise NotImplementedError

    def _note_crash(self, req: RequestState, reason: str, now: float) -> None:
        raise NotImplementedError

    def _retire_idle(self, now: float) -> None:
        raise NotImplementedError

    def _top_up(self) -> None:
        raise NotImplementedError

    def _forget_compiles(self) -> None:   # provided by Compiling
        raise NotImplementedError

    # --- zygote control channel -------------------------------------------
    def _on_control(self) -> None:
        while True:
            try:
                data, fds, flags, _ = socket.recv_fds(self._ctl, 4096, 2, socket.MSG_CMSG_CLOEXEC)
            except BlockingIOError:
                return
            except OSError:
                data, fds, flags = b"", [], 0
            if not data:
                for fd in fds:
                    os.close(fd)
                self._zygote_lost()
                return
            try:
                msg = msgpack.unpackb(data, raw=False)
            except Exception:
                msg = None
            if not isinstance(msg, dict):
                msg = {}
            t = msg.get("t")
            slot, pid = msg.get("slot"), msg.get("pid")
            if t == "spawned" and type(slot) is int and type(pid) is int and flags & socket.MSG_CTRUNC:
                self._truncated(slot, pid, fds)
                continue
            if t == "spawned" and type(slot) is int and type(pid) is int and fds:
                fork_ms = msg.get("fork_ms")
                self._register(slot, pid, fds[0], fds[1] if len(fds) > 1 else -1,
                               fork_ms if type(fork_ms) is float else 0.0)
                continue
            for fd in fds:
                os.close(fd)
            if t == "spawn_failed" and type(slot) is int:
                error = SandboxError.from_dict(msg.get("error"))
                log.error("sandbox fork server could not fork: %s", error.message)
                self._spawning.pop(slot, None)
                self._schedule_spawn(slot, backoff=True)
            elif t == "exit" and msg.get("code") == EXIT_NO_SECCOMP:
                log.error("sandbox worker %s exited before it was ready: its seccomp filter "
                          "did not load, and without it a worker must not run in the "
                          "network and IPC namespace all workers share", pid)
                if self._state == "starting":
                    self._state = "failed"   # every worker would: start() gives up now
            elif t == "exit":
                log.debug("sandbox worker %s exited (code %s, signal %s%s)", pid,
                          msg.get("code"), msg.get("signal"),
                          ", found by a walk of all children" if msg.get("walked") else "")

    def _truncated(self, slot: int, pid: int, fds: list[int]) -> None:
        """A new worker whose descriptors did not all arrive (this process is at its
        descriptor limit): without its pidfd it could only be signalled by pid,
        which, once it was reaped, may be another process's. It is not used: its
        channel closes, so it exits by itself, and the slot is forked again
        after the back-off."""
        for fd in fds:
            os.close(fd)
        log.warning("sandbox worker %s arrived without its descriptors (the service is at "
                    "its descriptor limit); forking another later", pid)
        self._spawning.pop(slot, None)
        self._reap(pid)
        if self._workers.get(slot) is None:
            self._schedule_spawn(slot, backoff=True, failed="a new worker arrived without its "
                                 "descriptors (%d failures in a row)")

    def _zygote_lost(self) -> None:
        if self._zygote_alive and self._state in ("starting", "running"):
            log.critical("sandbox fork server died: workers that exit can no longer be "
                         "replaced; restart the service")
        self._zygote_alive = False
        if self._loop is not None:
            self._loop.remove_reader(self._ctl.fileno())

    def _register(self, slot: int, pid: int, channel_fd: int, pidfd: int,
                  fork_ms: float = 0.0) -> None:
        asked = self._spawning.pop(slot, None)
        now = self._loop.time() if self._loop is not None else time.monotonic()
        w = WorkerHandle(slot, pid, channel_fd, pidfd, cache_size=self._compile_cache,
                         max_jobs=self.max_jobs + random.randint(0, self.max_jobs_jitter),
                         now=now)
        w.asked_at, w.fork_ms = asked or 0.0, fork_ms
        if self._state not in ("starting", "running") or self._workers.get(slot) is not None:
            w.signal(signal.SIGKILL)
            w.close(None)
            self._reap(pid)
            return
        self._workers[slot] = w
        self._unready += 1
        self._watched[w] = None   # the ticker watches its spawn timeout
        if self._loop is not None:
            self._loop.add_reader(w.fd, self._on_readable, w)
            self._ensure_tick()  # watches the spawn timeout

    def _request_spawn(self, slot: int) -> None:
        if (self._state not in ("starting", "running") or not self._zygote_alive
                or self._workers.get(slot) is not None):
            self._spawning.pop(slot, None)
            return
        self._spawning[slot] = time.monotonic()
        try:
            self._ctl.send(msgpack.packb({"t": "spawn", "slot": slot}))
        except OSError:
            self._spawning.pop(slot, None)  # housekeeping retries

    def _reap(self, pid: int) -> None:
        """Name an ending worker to the fork server, which then waits for it by
        its pid instead of walking all its children (``sandbox.zygote``).

        The names go out together once per turn of the loop: a burst of kills
        (hundreds retired at once for the memory budget) takes one message
        from the control socket's queue, which spawn requests need too."""
        if not (self._zygote_pid and self._zygote_alive):   # (not before start())
            return
        self._ending.append(pid)
        if self._naming:
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            self._name_ending()
        else:
            self._naming = True
            loop.call_soon(self._name_ending)

    def _name_ending(self) -> None:
        self._naming = False
        pids, self._ending = self._ending, []
        for i in range(0, len(pids), REAP_NAMES):
            try:
                self._ctl.send(msgpack.packb({"t": "reap", "pids": pids[i:i + REAP_NAMES]}))
            except OSError:
                return   # the fork server's walk of every child finds them

    def _schedule_spawn(self, slot: int, backoff: bool,
                        failed: str = "worker died %d times right after start") -> None:
        if self._state not in ("starting", "running"):
            return
        delay = 0.0
        if backoff:
            n = self._failures[slot] = self._failures.get(slot, 0) + 1
            delay = min(BACKOFF_FIRST_S * 2 ** (n - 1), BACKOFF_MAX_S)
            if n > 2:
                log.warning("sandbox slot %d: %s; next spawn in %.2fs", slot, failed % n, delay)
        if delay and self._loop is not None:
            self._spawning[slot] = time.monotonic()
            self._loop.call_later(delay, self._request_spawn, slot)
        else:
            self._request_spawn(slot)

    # --- taking workers out ----------------------------------------------
    def _elapsed(self, w: WorkerHandle) -> float:
        if w.req is None or self._loop is None:
            return 0.0
        return (self._loop.time() - w.req.t0) * 1000.0

    def _kill(self, w: WorkerHandle) -> None:
        """SIGKILL the worker and drop its channel at once."""
        w.signal(signal.SIGKILL)
        self._growers.pop(w, None)
        if not w.ready and w.alive:
            self._unready -= 1
        w.close(self._loop)
        self._reap(w.pid)
        if w.req is None:
            self._unpark(w)
        if self._workers.get(w.slot) is w:
            self._workers[w.slot] = None

    def _replace(self, w: WorkerHandle, outcome: Outcome | None, *, backoff: bool) -> None:
        """Kill ``w``, answer its request (if any) and spawn its successor."""
        if not w.alive:
            return
        req = w.req
        self._kill(w)
        if self._state == "running":
            self._c["restarts"] += 1
        if req is not None:
            self._busy -= 1
            if self._loop is not None:
                # Killed for its job (time-out, crash, protocol): the job also
                # pays for its worker's replacement.
                self._end(req, self._loop.time() - req.t0 + RESTART_COST_S)
            req.resolve(outcome or failure("crash", "sandbox worker was replaced", 0.0))
        if backoff:
            # Died before it was ready: the host's fault, retried with back-off.
            self._schedule_spawn(w.slot, backoff)
        else:
            # Spares are topped up at once: a crashing script is held back by
            # its quarantine, never by a slot left empty (the crash back-off
            # that once emptied the pool).
            self._workers.pop(w.slot, None)
            self._top_up()
        if self._loop is not None:
            self._pump()

    def _worker_lost(self, w: WorkerHandle) -> None:
        """The channel closed under us: the worker died without being told to."""
        if not w.alive:
            return
        now = self._loop.time() if self._loop is not None else time.monotonic()
        reason = "sandbox worker died during the invocation"
        if w.req is not None:
            self._c["crashes"] += 1
            log.warning("sandbox worker %d died during an invocation", w.pid)
            self._note_crash(w.req, reason, now)
        elif not w.ready and self._state in ("starting", "running"):
            log.error("sandbox worker %d died before it was ready", w.pid)
        # Only a worker that never became ready counts towards the spawn
        # back-off: no script has run in it, so the fault is the host's.
        self._replace(w, failure("crash", reason, self._elapsed(w)), backoff=not w.ready)

    def _merge_hardening(self, hard: dict[str, bool], notes: list[str]) -> None:
        for layer, on in hard.items():
            self._hardening[layer] = self._hardening.get(layer, True) and on
        for note in notes:
            layer, _, why = note.partition(": ")
            self._notes[layer] = why

    def _forget_loop(self) -> None:
        """The bound loop was closed: drop its timers, queue and in-flight work."""
        self._loop = None
        if self._naming:
            # Its call to _name_ending will not come: the names go out now, not
            # whenever the next kill is (the walk would reap those workers
            # meanwhile, and a late name could then name a new worker that
            # took one of their pids).
            self._name_ending()
        self._tick_handle = self._house_handle = None
        self._timeouts.clear()
        self._homeless.clear()
        self._queued.clear()
        self._sched = _fresh(self._sched)
        self._forget_compiles()
        for w in list(self._workers.values()):
            if w is not None and (w.req is not None or w.outbuf is not None):
                w.req = None  # its future belongs to the closed loop
                self._kill(w)
                self._workers.pop(w.slot, None)
        self._top_up()
        self._busy = 0

    # --- start-up reporting ----------------------------------------------
    def _abort_start(self) -> None:
        for w in list(self._workers.values()):
            if w is not None:
                self._kill(w)
        self._ctl.close()
        _reap_zygote(self._zygote_pid, 2.0)
        self._state = "stopped"

    def _log_hardening(self) -> None:
        active = [k for k, v in self._hardening.items() if v]
        log.info("sandbox pool: %d workers, active layers: %s", self.size, ", ".join(active))
        for layer, on in self._hardening.items():
            if not on:
                log.warning("sandbox layer %s is NOT active: %s", layer,
                            self._notes.get(layer, "unknown reason"))
        how = self._notes.get("seccomp_load", "")
        if how:   # which path installed the filter; the fallback costs ~2 ms per worker
            (log.info if how.startswith("prebuilt") else log.warning)(
                "sandbox seccomp filter: %s", how)
        if not MEMGUARD_AVAILABLE:
            log.warning("sandbox: _memguard extension missing; memory is measured with "
                        "tracemalloc after each run and enforced only by RLIMIT_AS")
        if not (METHODS_REPLACED and SLOTS_REPLACED):
            log.warning("sandbox: _typepatch extension missing; deque.index, "
                        "defaultdict.__missing__, list slice assignment and comparison, "
                        "bytearray %%, OrderedDict equality, dict.clear and dict.update, set changes "
                        "stay CPython's, whose use of freed memory scripts can reach")
        if not DATETIME_STATES_CHECKED:
            log.warning("sandbox: _datetime_state extension missing; a date built from a "
                        "pickled state of year 0 crashes its worker on ctime()")
        if not DECIMAL_SIGNALS_HELD:
            log.warning("sandbox: _decimal_signals extension missing; a decimal context's "
                        "flags and traps outlive it and read freed memory")
        if BEFORE_3_11_9:
            log.warning("sandbox: CPython %s lacks fixes of memory bugs scripts can reach "
                        "(3.11.9 and later have them); the known ones are worked around: "
                        "update the interpreter", platform.python_version())
        if not UNICODE_ERRORS_CHECKED:
            log.warning("sandbox: _unicode_errors extension missing; scripts cannot name "
                        "UnicodeDecodeError or UnicodeEncodeError (UnicodeError catches both)")


def _fresh(old: Scheduler) -> Scheduler:
    """An empty scheduler with ``old``'s settings (the loop it served was closed)."""
    return Scheduler(old.size, old.share, old.budget, old.window, old.clock)


def _reap_zygote(pid: int, timeout: float) -> None:
    """Wait for the zygote to exit, then SIGKILL it (blocking; stop and start only)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        time.sleep(0.005)
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
