"""The pool's clocks: the deadline ticker and the once-a-second housekeeping.

While work is in flight a timer every ``TICK_S`` walks the workers that have
a job (or are not ready yet) and the requests waiting with a deadline: a job
past its time limit gets its worker killed and replaced (the request is
answered ``script_timeout``, with where the script was if the worker said),
a worker that never became ready is replaced, a request that waited past the
queue timeout is answered busy. Housekeeping reads the resident size of a
bounded number of idle workers, retires idle ones and asks again for spawns
that never came. A mixin of :class:`sandbox.supervisor.Supervisor`, which
holds the state.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from sandbox import limits, protocol
from sandbox.channel import RequestState, WorkerHandle
from sandbox.errors import PoolBusyError
from sandbox.outcome import Outcome, failure

if TYPE_CHECKING:
    from sandbox.scheduler import Scheduler

log = logging.getLogger("sandbox.pool")

TICK_S = 0.005           # deadline ticker period while work is in flight
HOUSEKEEPING_S = 1.0     # RSS checks and spawn retries
RSS_CHECKS_PER_ROUND = 64  # idle workers whose /proc size one housekeeping round reads
#: CPU an idle worker may use between two housekeeping rounds that find it idle
#: with no job done in between: past it, it is a compromised worker's (one that
#: raised its own RLIMIT_CPU spun while idle, outside every budget: review,
#: session 30), killed.
IDLE_CPU_S = 0.05
#: CPU a worker may use after each reply, outside the time it held the request
#: (back to its poll; the message it answered freed at the next): far below
#: this. More, and it spun between its guild's jobs, which reset the rule above.
AFTER_REPLY_CPU_S = 0.002
#: Reads of a worker's channel before its job is timed out (a whole reply frame, 64 KiB a read).
READS_BEFORE_TIMEOUT = protocol.MAX_REPLY_BYTES // 65536 + 1


class Ticking:
    """Deadlines and housekeeping of ``Supervisor`` (which initialises the state)."""

    max_rss: int
    spawn_timeout: float
    _workers: dict[int, WorkerHandle | None]
    _watched: dict[WorkerHandle, None]
    _rss_turn: int
    _idle: deque[WorkerHandle]
    _timeouts: deque[tuple[float, RequestState]]
    _homeless: OrderedDict[str, RequestState]
    _queued: dict[Any, RequestState]
    _lru: OrderedDict[WorkerHandle, None]
    _sched: Scheduler
    _spawning: dict[int, float]
    _failures: dict[int, int]
    _loop: asyncio.AbstractEventLoop | None
    _tick_handle: asyncio.TimerHandle | None
    _house_handle: asyncio.TimerHandle | None
    _zygote_alive: bool
    _c: dict[str, int]
    _compiler: WorkerHandle | None    # sandbox.compiling
    _compiler_guild: str | None
    _spin_us: int

    if TYPE_CHECKING:  # provided by Supervisor and Pool
        def _note_crash(self, req: RequestState, reason: str, now: float) -> None: ...

        def _unhome(self, req: RequestState) -> None: ...

        def _on_readable(self, w: WorkerHandle) -> bool: ...

        def _retire_idle(self, now: float) -> None: ...

        def _request_spawn(self, slot: int) -> None: ...

        def _replace(self, w: WorkerHandle, outcome: Outcome | None, *,
                     backoff: bool) -> None: ...

        @staticmethod
        def _fell_into_debt(guild: str | None, script: str) -> None: ...

    def _ensure_tick(self) -> None:
        """Start the deadline ticker unless it runs (it stops when nothing is in flight)."""
        if self._tick_handle is None and self._loop is not None:
            self._tick_handle = self._loop.call_later(TICK_S, self._tick)

    def _tick(self) -> None:
        self._tick_handle = None
        assert self._loop is not None
        now = self._loop.time()
        pending = False
        # Only workers with a job or not ready yet (O(in flight), not O(workers):
        # a pool may keep thousands of idle guild workers).
        watched = self._watched
        for w in list(watched):
            req = w.req
            if not w.alive or (req is None and w.ready):
                del watched[w]
            elif req is not None:
                if now >= req.deadline and not self._answered(w, req):
                    if now >= req.deadline:   # a "compiled" read meanwhile moves it
                        self._timeout(w, req, now)
                    else:
                        pending = True
                elif w.req is not None:
                    pending = True
            else:
                if now - w.spawned_at > self.spawn_timeout:
                    log.error("sandbox worker %d did not become ready; killing it", w.pid)
                    self._replace(w, None, backoff=True)
                pending = True
        waiting = self._timeouts
        if waiting and now >= waiting[0][0]:
            # Before a waiting request is answered busy: a worker may have
            # answered during a stall, unread (it takes a waiting request now).
            for w in [w for w in watched if w.alive and w.req is not None]:
                if w.req is not None:
                    self._answered(w, w.req)
        # (deadline, request): live while the request waits (queued, or for its
        # guild's worker) with that deadline; other entries are stale.
        while waiting and (not waiting[0][1].queued and not waiting[0][1].homeless
                           or waiting[0][1].deadline != waiting[0][0] or now >= waiting[0][0]):
            until, req = waiting.popleft()
            if until != req.deadline:
                continue    # stale: the request re-entered the queue later
            if req.homeless:
                self._unhome(req)
            elif not self._sched.cancel(req):
                continue
            self._queued.pop(req.future, None)
            if not req.future.done():
                self._c["busy_rejections"] += 1
                req.future.set_exception(PoolBusyError("no sandbox worker became free in time"))
        if self._homeless and not self._zygote_alive:
            # No spare can come any more (the fork server died; logged as critical).
            for req in list(self._homeless.values()):
                self._unhome(req)
                self._queued.pop(req.future, None)
                if not req.future.done():
                    req.future.set_exception(PoolBusyError("no sandbox worker can be started"))
        if pending or waiting or self._homeless:
            self._ensure_tick()

    def _answered(self, w: WorkerHandle, req: RequestState) -> bool:
        """Whether ``req`` got its answer from what ``w`` had already sent.

        The loop's turns can stall (a large body decoded, the records writer
        holding the interpreter), and a tick due in the same turn runs before
        the worker's reader: a reply that came in time then waits unread while
        the tick finds the deadline passed. Read it first; a script the worker's
        own timer saw pass its limit is a time-out all the same (``Inbox``)."""
        for _ in range(READS_BEFORE_TIMEOUT):
            if not (w.alive and w.req is req) or not self._on_readable(w):
                break
        return not (w.alive and w.req is req)

    def _make_room(self, guild: str) -> None:
        """The queue is full: the guild with the longest queue gives up its newest
        request (``Scheduler.crowding``), so no guild's backlog keeps another guild
        out. Raises PoolBusyError when ``guild``'s own queue is the longest."""
        req: Any = self._sched.crowding(guild)
        if req is None:
            self._c["busy_rejections"] += 1
            raise PoolBusyError("sandbox queue is full")
        self._sched.cancel(req)
        self._queued.pop(req.future, None)
        if not req.future.done():
            self._c["busy_rejections"] += 1
            req.future.set_exception(PoolBusyError("sandbox queue is full"))

    def _timeout(self, w: WorkerHandle, req: RequestState, now: float) -> None:
        if req.kind == "job":
            self._c["timeouts"] += 1
        if req.kind == "job" and req.ships_source:
            # Past the compile budget before the script ran: a script error, not
            # its time limit's. Counted like a crash (a version that keeps doing
            # it is quarantined instead of taking a worker for the whole budget
            # at every request) only when the worker spent the save-time CPU
            # budget compiling: wall time alone may be the host's load, which a
            # caller sending many first requests at once could make, and must
            # not get a healthy version quarantined.
            log.info("sandbox worker %d passed the compile budget; killed", w.pid)
            spent = w.cpu_seconds() - req.cpu_at_ship
            if spent >= limits.COMPILE_CPU_BUDGET_S:
                self._note_crash(req, "its compile passed the compile budget", now)
            self._replace(w, failure(
                "script_error", f"script took too long to compile in its worker (more than "
                f"{limits.COMPILE_BUDGET_MS / 1000:g} s; the host may be overloaded)",
                (now - req.t0) * 1000.0), backoff=False)
            return
        # A script's own outcome (its history and error log say so): no line at
        # INFO per request, which a guild could send at its plan's rate.
        log.debug("sandbox worker %d passed the %d ms limit; killed", w.pid, req.limits.time_ms)
        message = f"script ran longer than {req.limits.time_ms} ms"
        out = failure("script_timeout", message, (now - req.t0) * 1000.0)
        if req.where is not None:
            # Where the worker said the script was when its time ran out.
            line, tb = req.where
            at = f" (stopped at line {line})" if line is not None else ""
            out = replace(out, error_message=message + at, error_line=line, traceback=tb)
        self._replace(w, out, backoff=False)

    def _housekeeping(self) -> None:
        assert self._loop is not None
        self._house_handle = self._loop.call_later(HOUSEKEEPING_S, self._housekeeping)
        # The resident-size backstop reads /proc for a bounded number of idle
        # workers per round, in turn (a worker also reports its size after
        # every job and retires past its growth bound by itself).
        idle = [*self._idle, *self._lru]
        if idle:
            start = self._rss_turn % len(idle)
            for w in (idle[start:] + idle[:start])[:RSS_CHECKS_PER_ROUND]:
                self._check_idle(w)
            self._rss_turn = start + RSS_CHECKS_PER_ROUND
        compiler = self._compiler
        if compiler is not None and compiler.req is None:
            # Idle between compiles, it is checked as any idle worker, every
            # round (review, session 33: a compile worker taken over by its
            # guild spun, or kept 300 MB, unchecked).
            self._check_idle(compiler)
        self._retire_idle(self._loop.time())
        now = time.monotonic()
        for slot, held in self._workers.items():
            asked = self._spawning.get(slot)
            if held is None and (asked is None or now - asked > self.spawn_timeout):
                self._request_spawn(slot)

    def _check_idle(self, w: WorkerHandle) -> None:
        if w.alive and w.rss() > self.max_rss:
            log.info("sandbox worker %d passed %d MiB RSS; recycled", w.pid, self.max_rss >> 20)
            self._replace(w, None, backoff=False)
        elif w.alive and self._spun_while_idle(w):
            log.error("sandbox worker %d used CPU while idle; killing it", w.pid)
            self._c["crashes"] += 1
            self._replace(w, None, backoff=False)

    def _spun_while_idle(self, w: WorkerHandle) -> bool:
        """Whether ``w`` used CPU between its requests since it was last looked
        at (or became ready): more than IDLE_CPU_S, plus AFTER_REPLY_CPU_S (and
        the configured spin) for each request it answered meanwhile, beyond the
        wall time it held them. A single-threaded process uses at most that
        wall time on its requests, so a guild's own requests no longer reset
        the check (review, session 33: a taken-over worker spun between its
        guild's jobs). What it used so is charged to its guild all the same."""
        cpu = w.cpu_seconds()
        seen, w.idle_cpu = w.idle_cpu, (w.jobs, w.busy_s, cpu)
        if seen is None:
            return False
        jobs, busy, before = seen
        outside = (cpu - before) - (w.busy_s - busy)
        guild = self._compiler_guild if w is self._compiler else w.guild
        if outside > 0 and guild is not None:
            if self._sched.charge(guild, outside):
                self._fell_into_debt(guild, "- (its worker's CPU between requests)")
        allowed = IDLE_CPU_S + (w.jobs - jobs) * (AFTER_REPLY_CPU_S + self._spin_us / 1e6)
        return outside > allowed

    def _clear_failures(self, w: WorkerHandle) -> None:
        if w.alive:
            self._failures[w.slot] = 0
