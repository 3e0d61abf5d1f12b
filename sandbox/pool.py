"""The supervised pool of pre-forked, hardened workers (service side).

``Pool.start()`` forks the fork server (``sandbox.zygote``) while the service
is still single-threaded and waits until every worker reported ready; from
then on workers are forked by the zygote, never by the service.  The event
loop side is lazily attached by the first ``await pool.run(...)``.

Hot path (PERFORMANCE.md): ``submit`` asks the fair queue
(``sandbox.scheduler``) for a run slot, takes an idle worker of the request's
guild (``sandbox.placement``: one guild per worker, warm spares, LRU
retirement, crash quarantine), writes one frame and returns a plain future;
the channel's reader callback decodes the reply and resolves that future
directly.  No task or ``wait_for`` per request: one ticker (every ``TICK_S``
while anything is in flight) enforces run deadlines and queue deadlines.

Supervision, after gunicorn's arbiter: a worker past its deadline is
SIGKILLed (through a pidfd, immune to pid reuse) and its channel closed at once
so a late reply can never be read as another request's answer; dead workers
are replaced at once by spares (exponential back-off only for workers that
die before they are ready: no script ran there); workers are recycled after ``max_jobs`` (plus
jitter) or when their RSS passes ``max_rss_mb``.  There is no separate
heartbeat: a worker is only ever asked to do something under a deadline,
and an idle worker that dies is seen at once as EOF on its channel.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from typing import Any

from sandbox import zygote
from sandbox.channel import RequestState, ScriptRef, WorkerHandle, readable
from sandbox.codecache import source_digest
from sandbox.compiling import COMPILER
from sandbox.errors import PoolClosedError, ProtocolError, SpawnError
from sandbox.hardening import HardeningConfig
from sandbox.limits import COMPILE_BUDGET_MS, Limits, current_address_space
from sandbox.outcome import Outcome, failure
from sandbox.inbox import Inbox
from sandbox.budget import derived_max_workers, derived_memory_budget
from sandbox.placement import Placement, sandbox_user
from sandbox.quarantine import QuarantineKey
from sandbox.scheduler import Scheduler
from sandbox.shutdown import Shutdown
from sandbox.ticking import HOUSEKEEPING_S
from sandbox.worker import WorkerConfig

__all__ = ["Pool", "ScriptRef", "Limits", "Outcome"]

log = logging.getLogger("sandbox.pool")


class Pool(Placement, Inbox, Shutdown):  # Inbox brings Compiling and Supervisor
    """Hardened workers, one guild per worker, behind an asyncio API.  See docs/architecture.md."""

    def __init__(self, size: int | None = None, *, queue_timeout_ms: int = 2000,
                 max_queue: int | None = None, max_jobs: int = 10_000, max_jobs_jitter: int = 1000,
                 max_rss_mb: int = 200, kill_grace_ms: int = 15, spawn_timeout_s: float = 10.0,
                 address_space_mb: int = 768, compile_cache: int = 256, user: str = "nobody",
                 network_namespace: bool = True, drop_user: bool = True, seccomp: bool = True,
                 landlock: bool = True, empty_root: bool = True, prefer_memguard: bool = True,
                 worker_spin_us: int = 0, fresh_interpreter: bool = True,
                 max_workers: int | None = None, spares: int | None = None,
                 guild_share: float = 0.5, guild_budget_s: float = 60.0,
                 idle_retire_s: float = 600.0, memory_budget_mb: int | None = None,
                 crash_limit: int = 3, crash_window_s: float = 60.0, quarantine_s: float = 60.0,
                 guild_workers: bool = True, code_cache_mb: int = 64,
                 _unsafe_test_hooks: bool = False) -> None:
        # Builds configuration only: nothing here changes the process.
        if size is not None and size < 1:
            raise ValueError("size must be at least 1")
        if queue_timeout_ms < 0 or max_jobs < 1 or max_jobs_jitter < 0:
            raise ValueError("queue_timeout_ms, max_jobs and max_jobs_jitter must be positive")
        self.size = size or os.cpu_count() or 1
        #: Memory the workers may hold together (an estimate, see Placement.memory_estimate);
        #: 0/None: half of the machine's (or the cgroup's) memory.
        self.memory_budget = (memory_budget_mb << 20 if memory_budget_mb
                              else derived_memory_budget())
        self._grown = 0
        #: Worker processes at most (spares and bound workers); 0/None: derived.
        self.max_workers = max(self.size, max_workers
                               or derived_max_workers(self.size, self.memory_budget))
        self.spares = spares if spares is not None else self.size
        self.spares = max(1, min(self.spares, self.max_workers))
        self.idle_retire_s = idle_retire_s
        self.crash_limit = crash_limit
        self.crash_window_s = crash_window_s
        self.quarantine_s = quarantine_s
        # False: every request counts as one guild ("" ), as before per-guild
        # workers (kept for the benchmark's baseline).
        self.guild_workers = guild_workers
        self.queue_timeout = queue_timeout_ms / 1000.0
        self.max_queue = max_queue if max_queue is not None else 256 * self.size
        self.max_jobs = max_jobs
        self.max_jobs_jitter = max_jobs_jitter
        self.max_rss = max_rss_mb * 1024 * 1024
        self.kill_grace = kill_grace_ms / 1000.0
        self.spawn_timeout = spawn_timeout_s
        self._address_space_mb = address_space_mb
        uid, gid = sandbox_user(user)
        self._hcfg = HardeningConfig(address_space=0, network_namespace=network_namespace,
                                     drop_user=drop_user, uid=uid, gid=gid, seccomp=seccomp,
                                     landlock=landlock, empty_root=empty_root)
        self._compile_cache = compile_cache
        self._prefer_memguard = prefer_memguard
        self._test_hooks = _unsafe_test_hooks
        self._spin_us = worker_spin_us
        # The zygote execs a new interpreter: no service memory in workers (R9).
        self._fresh_interpreter = fresh_interpreter
        self._workers: dict[int, WorkerHandle | None] = {}
        #: workers the deadline ticker looks at: with a job, or not ready yet
        self._watched: dict[WorkerHandle, None] = {}
        self._rss_turn = 0   # where the next round of RSS checks starts
        self._idle: deque[WorkerHandle] = deque()           # spares
        self._guild_idle: dict[str, list[WorkerHandle]] = {}
        self._lru: OrderedDict[WorkerHandle, None] = OrderedDict()
        self._once: OrderedDict[WorkerHandle, None] = OrderedDict()
        self._growers: dict[WorkerHandle, None] = {}   # grew by a worker's charge or more
        self._homeless: OrderedDict[str, RequestState] = OrderedDict()  # one per guild
        self._sched = Scheduler(self.size, guild_share, guild_budget_s)
        # (queue deadline, request) in deadline order; an entry whose request
        # left the queue (or re-entered it with a later deadline) is stale.
        self._timeouts: deque[tuple[float, RequestState]] = deque()
        self._queued: dict[asyncio.Future[Outcome], RequestState] = {}  # waiting, by future
        self._crashes: dict[QuarantineKey, deque[float]] = {}
        self._quarantine: dict[QuarantineKey, tuple[float, str, int]] = {}
        self._next_slot = 0
        self._failures: dict[int, int] = {}
        self._spawning: dict[int, float] = {}
        self._zygote_alive = True
        self._hardening: dict[str, bool] = {}
        self._notes: dict[str, str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tick_handle: asyncio.TimerHandle | None = None
        self._house_handle: asyncio.TimerHandle | None = None
        self._zygote_pid = 0
        self._ending: list[int] = []   # killed workers not yet named to the fork server
        self._naming = False           # a call to name them is scheduled on the loop
        self._state = "new"
        self._busy = 0
        self._unready = 0  # registered workers that have not said "ready" yet
        #: summed start-up cost of the workers that became ready (see spawn_steps)
        self._steps = dict.fromkeys(("n", "fork_call", "fork", "harden", "init", "total"), 0.0)
        self._c = dict.fromkeys(("invocations", "timeouts", "memory_kills", "crashes",
                                 "restarts", "busy_rejections", "queued", "deprioritised",
                                 "quarantined", "retired", "compiles", "compile_failures",
                                 "worker_compiles"),
                                0)
        self._init_compiling(code_cache_mb)

    # --- public properties ------------------------------------------------
    @property
    def counters(self) -> dict[str, int]:
        """invocations, timeouts, memory_kills, crashes, restarts, busy_rejections, queued,
        deprioritised, quarantined, retired, compiles, compile_failures, worker_compiles
        (versions a worker compiled for a job and offered to the code cache); queue_depth,
        code_rejected (cached code whose MAC failed), workers (processes, not counting the
        compile worker), guilds (with a bound worker)."""
        return {**self._c, "queue_depth": self._sched.waiting,
                "code_rejected": self._codes.rejected if self._codes is not None else 0,
                "workers": sum(1 for w in self._workers.values()
                               if w is not None and w.guild != COMPILER),
                "guilds": len({w.guild for w in self._workers.values()
                               if w is not None and w.guild not in (None, COMPILER)})}

    @property
    def scheduler(self) -> Scheduler:
        """The fair queue (read-only use: standing of guilds, for operators and tests)."""
        return self._sched

    @property
    def hardening(self) -> dict[str, bool]:
        """Which OS layers every worker reported active (False if any worker lacked it)."""
        return dict(self._hardening)

    @property
    def hardening_notes(self) -> dict[str, str]:
        """Why each inactive layer is inactive; ``seccomp_load``: how the filter was installed."""
        return dict(self._notes)

    @property
    def live_workers(self) -> int:
        """Workers that are up and hardened (idle or busy); not the compile worker."""
        return sum(1 for w in self._workers.values()
                   if w is not None and w.ready and w.guild != COMPILER)

    @property
    def worker_pids(self) -> list[int]:
        """Pids of live workers (for operators and tests); the compile worker's last."""
        live = [w for w in self._workers.values() if w is not None]
        return [w.pid for w in sorted(live, key=lambda w: w.guild == COMPILER)]

    # --- start -------------------------------------------------------------
    def start(self) -> None:
        """Fork the zygote and all workers; call before any event loop or thread exists.

        Raises SpawnError when the workers cannot be started.
        """
        if self._state != "new":
            raise RuntimeError("Pool.start() may be called once")
        self._state = "starting"
        if threading.active_count() > 1:
            log.warning("sandbox Pool.start() called with %d threads running; start the pool "
                        "before any thread or event loop (a fork can copy a held lock)",
                        threading.active_count())
        # RLIMIT_AS backstop: what a worker maps after start-up plus head-room.
        base = current_address_space()
        self._hcfg = HardeningConfig(**{**self._hcfg.__dict__,
                                        "address_space": base + (self._address_space_mb << 20)})
        cfg = WorkerConfig(self._hcfg, self._compile_cache, self._prefer_memguard,
                           self._test_hooks, self._spin_us)
        self._zygote_pid, self._ctl = zygote.start(cfg, self._fresh_interpreter)
        self._ctl.setblocking(False)
        # The spares, plus the compile worker (sandbox.compiling) when code is cached.
        initial = self.spares + (self._codes is not None)
        for slot in range(initial):
            self._workers[slot] = None
            self._request_spawn(slot)
        self._next_slot = initial
        deadline = time.monotonic() + self.spawn_timeout
        while self.live_workers < initial:
            left = deadline - time.monotonic()
            if left <= 0 or self._state != "starting" or not self._zygote_alive:
                self._abort_start()
                raise SpawnError("sandbox workers did not start; see the log")
            pending = [w for w in self._workers.values() if w is not None and not w.ready]
            ready = readable([self._ctl] + [w.sock for w in pending], left)
            for sock in ready:
                if sock is self._ctl:
                    self._on_control()
                else:
                    self._on_readable(next(w for w in pending if w.sock is sock))
        self._state = "running"
        if self._codes is not None:
            self._compile_worker()
        self._log_hardening()

    def attach(self) -> None:
        """Bind to the running event loop now (else the first ``run`` does it).

        Until then worker deaths are only noticed when work arrives.  A pool
        whose loop was closed re-binds to the running one (test suites that
        make a loop per test); requests of the closed loop are dropped.
        Raises PoolClosedError when the pool is not running, RuntimeError when
        it is bound to another loop that is still open.
        """
        if self._loop is not asyncio.get_running_loop():
            self._attach()

    def _attach(self) -> asyncio.AbstractEventLoop:
        if self._state != "running":
            raise PoolClosedError("pool is not running")
        loop = asyncio.get_running_loop()
        old = self._loop
        if old is loop:
            return loop
        if old is not None:
            if not old.is_closed():
                raise RuntimeError("the pool is bound to another event loop")
            self._forget_loop()
        self._loop = loop
        loop.add_reader(self._ctl.fileno(), self._on_control)
        for w in self._workers.values():
            if w is not None:
                loop.add_reader(w.fd, self._on_readable, w)
        self._house_handle = loop.call_later(HOUSEKEEPING_S, self._housekeeping)
        return loop

    # --- the hot path ------------------------------------------------------
    async def run(self, ref: ScriptRef, event: dict[str, Any], limits: Limits,
                  guild: str = "") -> Outcome:
        """Run the script's endpoint block for one event, on a worker of ``guild``.

        Raises PoolBusyError when no worker frees within the queue timeout or
        the wait queue is full, PoolClosedError when the pool is not running.
        """
        return await self.submit(ref, event, limits, guild)

    def submit(self, ref: ScriptRef, event: dict[str, Any], limits: Limits, guild: str = ""
               ) -> asyncio.Future[Outcome]:
        """`run` without a coroutine: the future of the outcome (callers add a callback).

        ``guild`` is the tenant: the request runs only on a worker bound to it
        and is scheduled fairly against other guilds' requests.  Must be called
        on the event loop's thread. Raises PoolBusyError when the wait queue is
        full, PoolClosedError when the pool is not running; the future fails
        with PoolBusyError when no worker frees within the queue timeout.
        ``withdraw(future)`` takes a queued request out of the queue at once
        (a cancelled future is skipped when its turn comes).
        """
        loop = self._loop
        if loop is None:
            loop = self._attach()
        elif self._state != "running":
            raise PoolClosedError("pool is stopping")
        elif asyncio.get_running_loop() is not loop:
            loop = self._attach()
        if not self.guild_workers:
            guild = ""
        req = RequestState(loop.create_future(), "job", ref, event, limits, guild)
        req.dig = source_digest(ref.key, ref.version, ref.source)
        if self._quarantine:
            answer = self._quarantined(req, loop.time())
            if answer is not None:
                req.future.set_result(answer)
                return req.future
        sched = self._sched
        if not sched.waiting:
            excess = sched.start(guild)
            if excess >= 0:
                req.excess = excess == 1
                req.seated = True
                self._seat(req)
                return req.future
        if sched.waiting >= self.max_queue:
            self._make_room(guild)
        req.deadline = loop.time() + self.queue_timeout
        self._queued[req.future] = req
        if sched.push(req):
            self._pump()  # a fair request may run beside other guilds' waiting excess
            if not req.queued:
                return req.future
        req.waited = True
        self._c["queued"] += 1
        if req.deprioritised:
            self._c["deprioritised"] += 1
        self._timeouts.append((req.deadline, req))
        self._ensure_tick()
        return req.future

    def _dispatch(self, w: WorkerHandle, req: RequestState) -> None:
        assert self._loop is not None
        if req.kind == "job" and self._codes is not None and self._await_code(w, req):
            return   # dispatched again once the compile worker answered
        w.sent += 1
        req.id = w.sent
        try:
            frame = w.job_frame(req, self._codes)
        except ProtocolError as exc:
            self._park(w, self._loop.time())
            self._end(req, 0.0)
            req.resolve(failure("script_error", f"invocation cannot be sent: {exc.message}", 0.0))
            self._pump()
            return
        now = self._loop.time()
        req.t0 = now
        # Compiling a large script can take longer than the script may run; it
        # happens once per version and worker, under its own budget, and the
        # script's clock starts when the worker says "compiled".
        budget_ms = COMPILE_BUDGET_MS if req.ships_source else req.limits.time_ms
        req.deadline = now + budget_ms / 1000.0 + self.kill_grace
        req.worker = w
        w.req = req
        self._watched[w] = None
        self._busy += 1
        if req.kind == "job":
            self._c["invocations"] += 1
        self._ensure_tick()
        if not w.send(frame, self._loop, self._on_writable):
            # The worker died before it could take the job (its EOF is not
            # processed yet): replace it and give the request another worker.
            w.req = None
            self._busy -= 1
            if req.kind == "job":
                self._c["invocations"] -= 1
            self._worker_lost(w)
            self._seat(req)

    def _on_writable(self, w: WorkerHandle) -> None:
        if not w.flush(self._loop):
            self._worker_lost(w)
