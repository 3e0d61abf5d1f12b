"""Which worker process runs a request: guild binding, warm spares, retirement.

A worker is bound to one guild from its first job to its exit; a worker that
has run guild A's code never runs guild B's (state left in CPython's caches
cannot cross tenants).  Processes, at most ``max_workers`` of them:

* *spares*: forked by the fork server, hardened, never ran a script
  (``Pool._idle``).  ``spares`` of them are kept ready, so a new guild gets
  its worker at the cost of a fork that already happened.
* *bound* workers: idle ones wait in their guild's list (``_guild_idle``)
  and in one least-recently-used order over all guilds (``_lru``).

A request holding a run slot (``sandbox.scheduler``) takes an idle worker of
its guild, else a spare; with neither it gives its run slot back and waits for
a worker of its guild (``_homeless``, one request per guild, one spare forked
for it), the scheduler holding the guild's other requests.  A run slot bounds
the scripts that run, and a request waiting for a process start runs nothing:
the slot serves guilds with warm workers meanwhile.  When the worker is ready
the request goes back to the front of its guild's queue, and its guild to the
front of the round robin (it had its turn), so it runs next.  The wait has the
queue timeout, and the request can be withdrawn, as in the queue.  Spares are
replenished by forking while there is room under ``max_workers``, else by
retiring an idle bound worker: the least recently used of those that served a
single job while they are at least an eighth of the idle workers, else the
least recently used (``_lru_victim``), so guilds called once make room for
each other before popular guilds lose theirs.  A bound worker idle for
``idle_retire_s`` is retired too, so the pool shrinks when guilds go quiet.
Memory: each worker is charged ``WORKER_BYTES`` plus what it reported it grew
since its first job; no spare is forked past ``memory_budget``, and
housekeeping retires least recently used idle workers while over it.

Crash quarantine is ``sandbox.quarantine``.
"""
from __future__ import annotations

import asyncio
import logging
import pwd
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any

from sandbox.budget import WORKER_BYTES
from sandbox.channel import RequestState, WorkerHandle
from sandbox.outcome import Outcome
from sandbox.quarantine import Quarantine
from sandbox.scheduler import Scheduler

log = logging.getLogger("sandbox.pool")

def sandbox_user(name: str) -> tuple[int, int]:
    """uid and gid of ``name`` (``nobody``'s numbers when it does not exist)."""
    try:
        entry = pwd.getpwnam(name)
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


#: Retirement protects guilds called more than once: while at least one idle
#: worker in ``ONCE_SHARE`` served a single job, those go first (least recently
#: used first).  Under a long-tailed load most new guilds are called once, and
#: plain LRU would retire popular guilds' workers to make room for them.
ONCE_SHARE = 8


class Placement(Quarantine):
    """Worker placement state and methods shared with ``Pool`` (which initialises them)."""

    max_workers: int
    memory_budget: int
    #: What the workers grew in all (as of the last housekeeping round).
    _grown: int
    spares: int
    idle_retire_s: float
    _loop: asyncio.AbstractEventLoop | None
    _state: str
    _workers: dict[int, WorkerHandle | None]
    _watched: dict[WorkerHandle, None]
    _spawning: dict[int, float]
    _idle: deque[WorkerHandle]
    _guild_idle: dict[str, list[WorkerHandle]]
    _lru: OrderedDict[WorkerHandle, None]
    _once: OrderedDict[WorkerHandle, None]    # the idle workers of _lru that served <= 1 job
    _growers: dict[WorkerHandle, None]        # workers that reported growing by WORKER_BYTES+
    _homeless: OrderedDict[str, RequestState]
    _queued: dict[Any, RequestState]
    _timeouts: deque[tuple[float, RequestState]]
    queue_timeout: float
    _sched: Scheduler
    _next_slot: int
    _unready: int
    _c: dict[str, int]
    _compiler: WorkerHandle | None
    _zygote_alive: bool

    if TYPE_CHECKING:  # provided by Pool / Supervisor (after this class in the MRO)
        def _dispatch(self, w: WorkerHandle, req: RequestState) -> None: ...

        def _request_spawn(self, slot: int) -> None: ...

        def _kill(self, w: WorkerHandle) -> None: ...

        def _ensure_tick(self) -> None: ...

    def withdraw(self, future: "asyncio.Future[Outcome]") -> bool:
        """Take a request that still waits in the queue out of it (its client left):
        True if it never reached a worker, and then its future is cancelled.  A
        request already running is left to finish (False)."""
        req = self._queued.pop(future, None)
        if req is None:
            return False
        if req.homeless:
            self._unhome(req)
        elif not self._sched.cancel(req):
            return False
        future.cancel()
        return True

    # --- run slots --------------------------------------------------------------
    def _pump(self) -> None:
        """Give free run slots to queued requests (round robin, see the scheduler)."""
        sched = self._sched
        while sched.waiting:
            req: Any = sched.pop()
            if req is None:
                return
            req.seated = True
            self._queued.pop(req.future, None)
            if req.future.done():   # cancelled; its done-callback has not run yet
                self._end(req, 0.0)
                continue
            self._seat(req)

    def _end(self, req: RequestState, cost_s: float) -> None:
        """The request gives its run slot back; ``cost_s`` is charged to its guild."""
        if not req.seated:
            return
        req.seated = False
        if self._sched.finish(req.guild, cost_s + req.held_s, req.excess):
            self._fell_into_debt(req.guild, getattr(req.ref, "key", "-"))

    @staticmethod
    def _fell_into_debt(guild: str | None, script: str) -> None:
        log.warning("sandbox: guild %s is over its worker-time budget (last: script %s); "
                    "its requests are served only when no other guild waits",
                    guild or "-", script)

    def _seat(self, req: RequestState) -> None:
        """Find a worker for a request that holds a run slot."""
        guild = req.guild
        idle = self._guild_idle.get(guild)
        if idle:
            w = idle.pop()   # an emptied list stays (no churn on the hot path)
            del self._lru[w]
            if self._once:
                self._once.pop(w, None)
            self._dispatch(w, req)
        elif self._idle:
            w = self._idle.pop()
            w.guild = guild
            self._dispatch(w, req)
            self._top_up()
        else:
            # The slot serves warm guilds while a worker starts; the guild's
            # other requests stay queued (held) meanwhile.
            self._end(req, 0.0)
            assert self._loop is not None
            if guild in self._homeless:
                # One of the guild's requests waits for its worker already (this
                # one was seated before, e.g. while its code was compiled): it
                # waits in the guild's queue, first.
                self._requeue(req)
                return
            self._sched.hold(guild)
            req.homeless = True
            req.deadline = deadline = self._loop.time() + self.queue_timeout
            self._homeless[guild] = req
            self._queued[req.future] = req
            self._timeouts.append((deadline, req))
            self._top_up()          # one spare more for this guild
            self._ensure_tick()

    def _unhome(self, req: RequestState) -> None:
        """``req`` stops waiting for a worker (withdrawn, timed out): its guild is served again."""
        req.homeless = False
        if self._homeless.get(req.guild) is req:
            del self._homeless[req.guild]
        self._sched.release(req.guild)

    def _resume(self, req: RequestState) -> None:
        """A request that waited for its guild's worker takes its place back: the
        front of its guild's queue, its guild at the front of the round robin."""
        self._unhome(req)
        if not req.future.done():
            self._requeue(req)

    def _requeue(self, req: RequestState) -> None:
        """``req`` (which had its turn) waits first in its guild's queue, with a fresh
        queue timeout."""
        assert self._loop is not None
        req.deadline = deadline = self._loop.time() + self.queue_timeout
        self._queued[req.future] = req
        if not req.waited:
            req.waited = True
            self._c["queued"] += 1
        self._sched.push(req, resume=True)
        self._timeouts.append((deadline, req))
        self._ensure_tick()

    # --- idle workers -----------------------------------------------------------
    def _park(self, w: WorkerHandle, now: float) -> None:
        """``w`` finished its job and stays: idle for its guild (or a spare)."""
        if w.guild is None:
            self._idle.append(w)
            return
        self._idle_for_guild(w, now)
        if self._homeless:
            # A request waits for a worker while every process was busy: this
            # guild's takes this one (the caller pumps), else it makes room for a spare.
            waiting = self._homeless.get(w.guild)
            if waiting is not None:
                self._resume(waiting)
            else:
                self._top_up()

    def _idle_for_guild(self, w: WorkerHandle, now: float) -> None:
        """Put ``w`` (bound to a guild) among the idle workers."""
        assert w.guild is not None
        idle = self._guild_idle.get(w.guild)
        if idle is None:
            self._guild_idle[w.guild] = [w]
        else:
            idle.append(w)
        self._lru[w] = None
        if w.jobs <= 1:
            self._once[w] = None
        w.idle_since = now

    def _unpark(self, w: WorkerHandle) -> None:
        """Take ``w`` out of whichever idle structure holds it."""
        if w in self._lru:
            del self._lru[w]
            self._once.pop(w, None)
            idle = self._guild_idle.get(w.guild or "")
            if idle is not None and w in idle:
                idle.remove(w)
            return
        try:
            self._idle.remove(w)
        except ValueError:
            pass

    def _on_spare(self, w: WorkerHandle) -> None:
        """A new worker is ready: the guild that waited longest for one gets it
        (its requests go back to the queue's front), else it is a spare."""
        homeless = self._homeless
        while homeless:
            req = next(iter(homeless.values()))
            if req.future.done():
                self._unhome(req)
                continue
            w.guild = req.guild
            self._resume(req)
            assert self._loop is not None
            self._idle_for_guild(w, self._loop.time())
            self._pump()            # the request takes it before any room is made
            if homeless:
                self._top_up()
            return
        self._idle.append(w)
        self._pump()

    def _top_up(self) -> None:
        """Fork (or make room for) spares: ``spares`` ready plus one per guild waiting for one."""
        want = (self.spares + len(self._homeless) - len(self._idle) - len(self._spawning)
                - self._unready)
        # The compile worker (sandbox.compiling) is not one of the max_workers.
        compiler = self._compiler
        extra = 1 if compiler is not None and self._workers.get(compiler.slot) is compiler else 0
        # Without the fork server nothing replaces a worker: none is retired to
        # make room (review, session 33: each new guild's request retired a
        # warm worker of another guild, which then had none either).
        while want > 0 and self._state in ("starting", "running") and self._zygote_alive:
            if (len(self._workers) - extra < self.max_workers
                    and (len(self._workers) + 1) * WORKER_BYTES + self._grown
                    <= self.memory_budget):
                slot = self._next_slot
                self._next_slot += 1
                self._workers[slot] = None
                self._request_spawn(slot)
            else:
                # Over the memory budget (not the count): a worker that grew goes
                # first, as in housekeeping, before any lean one makes room.
                w = ((self._grower_victim() if len(self._workers) - extra < self.max_workers
                      else None) or self._lru_victim())
                if w is None:
                    return
                self._c["retired"] += 1
                self._kill(w)          # its slot is free: a spare is forked into it
                self._request_spawn(w.slot)
            want -= 1

    def _grower_victim(self) -> WorkerHandle | None:
        """The idle worker that grew most (by at least ``WORKER_BYTES``), of a guild
        with nothing queued; None if there is none."""
        guilds = self._sched.guilds
        best: WorkerHandle | None = None
        for w in self._growers:
            g = guilds.get(w.guild or "")
            if (w in self._lru and (g is None or not g.queue)
                    and (best is None or w.rss_last - w.rss_first > best.rss_last - best.rss_first)):
                best = w
        return best

    def _lru_victim(self) -> WorkerHandle | None:
        """The idle worker to retire for a spare: the least recently used of those
        that served one job while they are at least 1/``ONCE_SHARE`` of the idle
        workers, else the least recently used of all; preferably not one whose
        guild has a request queued (it would only start another process for it),
        but when a request waits for a worker and only such workers are idle, the
        least recently used of them (else a guild with a backlog would keep
        every worker while another guild's request waits for ever)."""
        guilds = self._sched.guilds
        for order in ((self._once, self._lru) if len(self._once) * ONCE_SHARE >= len(self._lru)
                      else (self._lru,)):
            for w in order:
                g = guilds.get(w.guild or "")
                if g is None or not g.queue:
                    return w
        if self._homeless and self._lru:
            return next(iter(self._lru))
        return None

    def _retire_idle(self, now: float) -> None:
        """Housekeeping: retire bound workers idle for ``idle_retire_s`` (oldest first),
        then least recently used idle ones while the memory estimate is over budget."""
        lru = self._lru
        while lru:
            w = next(iter(lru))
            if now - w.idle_since < self.idle_retire_s:
                break
            self._retire(w)
        used = self.memory_estimate()
        if used > self.memory_budget and lru:
            # Idle workers that grew go first, the largest first: what they keep
            # put the pool over, so one guild's growth does not retire other
            # guilds' lean workers before its own; then the least recently used.
            growers = sorted((w for w in lru if w.rss_last > w.rss_first),
                             key=lambda w: w.rss_first - w.rss_last)
            for w in growers:
                if used <= self.memory_budget:
                    break
                used -= WORKER_BYTES + (w.rss_last - w.rss_first)
                self._retire(w)
        while lru and used > self.memory_budget:
            w = next(iter(lru))
            used -= WORKER_BYTES + max(0, w.rss_last - w.rss_first)
            self._retire(w)
        self._grown = used - len(self._workers) * WORKER_BYTES
        self._sched.sweep()
        for guild in [g for g, idle in self._guild_idle.items() if not idle]:
            del self._guild_idle[guild]
        self._sweep_quarantine(now)

    def _retire(self, w: WorkerHandle) -> None:
        """Retire an idle bound worker and free its slot."""
        self._c["retired"] += 1
        self._kill(w)
        self._workers.pop(w.slot, None)

    def memory_estimate(self) -> int:
        """Bytes the pool's workers hold beyond the fork server's shared pages:
        ``WORKER_BYTES`` each plus what each grew since its first job (as it
        reported after its last one)."""
        return sum(WORKER_BYTES + max(0, w.rss_last - w.rss_first) if w is not None
                   else WORKER_BYTES for w in self._workers.values())
