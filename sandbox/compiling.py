"""`Compiling`: the pool's compile worker and the code cache in front of the workers.

A script version is compiled once per service process, not once per worker:
when a request is about to go to a worker that lacks its version (key,
version, source digest) and the :class:`~sandbox.codecache.CodeCache` has no
code for it either, the request keeps its run slot and its worker while the
*compile worker* compiles the source and returns marshalled code (as they
waited while the worker compiled, before); then it is dispatched, and every
worker that lacks the version receives the code with the job and loads it
(``marshal.loads``, microseconds) instead of compiling it. Requests for a
version already being compiled share that compile.

A request never waits behind another version's compile, nor for a compile
worker of its own guild: when the compile worker is busy with another source
or bound to another guild, the request goes on without code and its own
worker compiles it (so one guild's large sources cannot hold other guilds'
requests and run slots, and no spare is spent on switching the compile
worker); a fresh worker offers the code to the cache (below). Long sources
are also queued for the compile worker to compile later, for the cache (a
bounded queue nobody waits for); only requests for the version being
compiled right now wait for it.

The compile worker is a spare taken out of the spare list (hardened like any
worker, and it never ran a script) that never runs a script: it only answers
``compile`` messages, one at a time, each within ``limits.COMPILE_BUDGET_MS``
(the deadline ticker kills it past that, as a worker past its time limit) and
under the compile memory cap.  It is retired like a worker (memory growth, job
count) and replaced by the next spare.

Code compiled for a guild is only ever loaded by that guild's workers: the
guild is part of every cache key (``(guild, script key, version, digest)``),
and a compile worker compiles the sources of one guild only.  It is bound to
the guild of the first source it is sent; before a source of another guild is
compiled it is killed and a fresh spare takes its place (sources of the bound
guild that wait are sent first, so a switch costs one spare per run of guilds,
not one per source).  A guild that took over the compile worker through a
bug in CPython's parser or compiler can therefore plant bytecode only in its
own workers, which run its code anyway.

When no compile worker can be had at once (no spare ready, or the fork
server is gone) or a compile fails to come back, the request goes without
code and its worker compiles the source itself, as before this cache existed:
slower, never wrong.  A worker that has never run a script offers the
marshalled code with its ``compiled`` message, sent before the script runs:
until then it has seen nothing but compiler input, and it is bound to the
request's guild for life, exactly as a compile worker bound to that guild;
the cache keeps the code under that guild (``_worker_compiled``; the same MAC,
the same key) and a compile of that version queued for the compile worker is
dropped.  A worker that has run a script never offers code (the service
refuses it: a script may have taken the process over); what it compiles
stays in its own cache of loaded versions (256).  Only sources longer than
``OFFERED_SOURCE_CHARS`` are queued for the compile worker to compile for the
cache; the source stays queued until a spare is ready (the queue is emptied
only when the fork server is gone).
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from sandbox.channel import RequestState, WorkerHandle
from sandbox.codecache import CodeCache, CodeKey
from sandbox.compile_queue import has_room
from sandbox.limits import COMPILE_BUDGET_MS, COMPILE_MEMORY_BYTES, Limits

from sandbox.outcome import failure
from sandbox.scheduler import Scheduler

log = logging.getLogger("sandbox.pool")

#: The guild mark of the compile worker: no request's guild can be this.
COMPILER = "\x00compile"
#: Sources at most this long are left to the worker that compiles them for a job,
#: which offers the code (under protocol.MAX_SHIPPED_CODE: ordinary code marshals
#: to about twice its source; the compiler refuses more than that bound);
#: longer ones are queued for the compile worker.
OFFERED_SOURCE_CHARS = 128 * 1024
#: Offered code larger than this many bytes per source character (plus 64 KiB)
#: is not kept: a crafted offer could otherwise flush the shared cache.
OFFER_PER_SOURCE_CHAR = 16


class Compiling:
    """Compile-worker state and methods shared with ``Pool`` (which initialises them)."""

    kill_grace: float
    _codes: CodeCache | None
    _workers: dict[int, WorkerHandle | None]
    _watched: dict[WorkerHandle, None]
    _compiler: WorkerHandle | None
    #: The guild whose sources the compile worker compiles (None: none sent yet).
    _compiler_guild: str | None
    _compiles: dict[CodeKey, "asyncio.Future[Any]"]
    _compile_q: deque[tuple[CodeKey, str, "asyncio.Future[Any]"]]
    _compiling_now: CodeKey | None
    #: Compiles queued for the cache (``_compile_later``): the guild pays for them.
    _for_cache: set[CodeKey]
    _sched: Scheduler
    _idle: deque[WorkerHandle]
    _loop: asyncio.AbstractEventLoop | None
    _busy: int
    _c: dict[str, int]
    _state: str
    _zygote_alive: bool

    if TYPE_CHECKING:  # provided by Pool / Supervisor (after this class in the MRO)
        def _top_up(self) -> None: ...

        def _ensure_tick(self) -> None: ...

        def _on_writable(self, w: WorkerHandle) -> None: ...

        def _worker_lost(self, w: WorkerHandle) -> None: ...

        def _kill(self, w: WorkerHandle) -> None: ...

        def _dispatch(self, w: WorkerHandle, req: RequestState) -> None: ...

        def _seat(self, req: RequestState) -> None: ...

        def _park(self, w: WorkerHandle, now: float) -> None: ...

        def _end(self, req: RequestState, cost_s: float) -> None: ...

        def _pump(self) -> None: ...

        @staticmethod
        def _fell_into_debt(guild: str | None, script: str) -> None: ...

    def _init_compiling(self, code_cache_mb: int) -> None:
        """The code cache (None with ``code_cache_mb`` 0: workers compile, as before)."""
        self._codes = CodeCache(code_cache_mb << 20) if code_cache_mb > 0 else None
        self._compiler = None
        self._compiler_guild = None
        self._compiles = {}
        self._compile_q = deque()
        self._compiling_now = None
        self._for_cache = set()

    def _forget_compiles(self) -> None:
        """The event loop closed (``Supervisor._forget_loop``): compiles waited for
        on it are forgotten (their futures were its own; a busy compile worker is
        killed with its job), so the next loop compiles those versions again."""
        self._compiles.clear()
        self._compile_q.clear()
        self._for_cache.clear()
        self._compiling_now = None

    def _await_code(self, w: WorkerHandle, req: RequestState) -> bool:
        """Before a job goes to ``w``: when ``w`` lacks the version and the cache has no
        code for it, compile it in the compile worker first and return True (``w`` and
        the run slot wait for it, as they waited for a compile in ``w`` before);
        ``_dispatch`` is called again when the compile answered."""
        ref = req.ref
        # The cache's key names the guild: code compiled for one guild is never
        # shipped to another guild's worker.
        key = (req.guild, ref.key, ref.version, req.dig)
        codes = self._codes
        if codes is None or req.code_waited or key[1:] in w.known or key in codes:
            return False
        compiling = self._compiles.get(key)
        if compiling is not None and key != self._compiling_now:
            return False   # queued behind other sources: this worker compiles it itself
        if compiling is None:
            busy = self._compiler
            if self._compile_q or (busy is not None and busy.alive and busy.req is not None):
                # Never queue behind another compile (another guild's big source would
                # hold this request and its run slot): this worker compiles it, as
                # before; a worker that never ran a script offers the code
                # (``_worker_compiled``). Only long sources are compiled later for
                # the cache: a short one costs a worker ~1 ms, less than the
                # spare a compile-worker switch would take from new guilds.
                if len(ref.source) > OFFERED_SOURCE_CHARS:
                    self._compile_later(key, ref.source)
                return False
            if (busy is not None and busy.alive and self._compiler_guild is not None
                    and self._compiler_guild != req.guild):
                # The compile worker is bound to another guild: switching would
                # cost a spare that new guilds' requests wait for; this worker is
                # bound to the request's guild and compiles it (and offers the code
                # if it never ran a script; long sources are compiled later).
                if len(ref.source) > OFFERED_SOURCE_CHARS:
                    self._compile_later(key, ref.source)
                return False
            assert self._loop is not None
            compiling = self._loop.create_future()
            self._compiles[key] = compiling
            self._compile_q.append((key, ref.source, compiling))
            self._next_compile()
            if compiling.done():
                return False   # no compile worker now: this worker compiles, as before
        req.code_waited = True   # once: a compile that failed is not asked for again
        assert self._loop is not None
        started = self._loop.time()
        compiling.add_done_callback(functools.partial(self._code_ready, w, req, started))
        return True

    def _compile_later(self, key: CodeKey, source: str) -> None:
        """Queue a compile nobody waits for (the cache gets the version off the request
        path), within the queue's bounds (``sandbox.compile_queue``)."""
        q = self._compile_q
        if key in self._compiles or self._loop is None or not has_room(q, key[0], source):
            return
        future: asyncio.Future[Any] = self._loop.create_future()
        self._compiles[key] = future
        self._for_cache.add(key)
        q.append((key, source, future))
        self._next_compile()

    def _code_ready(self, w: WorkerHandle, req: RequestState, started: float,
                    _: "asyncio.Future[Any]") -> None:
        """The compile the request waited for answered (or failed): dispatch it now.
        The wait held a run slot: it is charged to the guild like the job's time."""
        if self._loop is not None:
            req.held_s += self._loop.time() - started
        if req.future.done() or self._state not in ("running", "stopping"):
            # Its caller went away (or the pool stopped): give the slot and the worker back.
            # (While stopping, an admitted request still runs, as running jobs do.)
            self._end(req, 0.0)
            req.resolve(failure("crash", "sandbox pool stopped", 0.0))
            if w.alive and self._state == "running":
                self._park(w, self._loop.time() if self._loop is not None else 0.0)
                self._pump()
            return
        if not w.alive:
            self._seat(req)   # the worker died meanwhile: another one takes the request
            self._pump()      # (or it waits for one, and gave its slot back)
            return
        self._dispatch(w, req)

    def _compile_worker(self, guild: str | None = None) -> WorkerHandle | None:
        """The compile worker for ``guild``'s sources (None: any, without retiring one).

        The current one while it is busy (its answer comes first) or bound to
        ``guild`` or to no guild yet; one bound to another guild is killed and a
        spare takes its place.  None when no spare is ready (then the current one
        stays, bound to its guild) or the fork server is gone.
        """
        w = self._compiler
        if w is not None and w.alive and (guild is None or w.req is not None
                                          or self._compiler_guild in (None, guild)):
            return w
        if not self._idle or not self._zygote_alive:
            return None   # the last spare stays a spare when no new one can be forked
        if w is not None and w.alive:
            # It compiled another guild's sources: that guild may have taken it
            # over (a parser or compiler bug); it never compiles for anyone else.
            self._compiler = None
            self._kill(w)
            self._workers.pop(w.slot, None)
        w = self._idle.pop()
        w.guild = COMPILER
        self._compiler = w
        self._compiler_guild = None
        self._top_up()
        return w

    def _next_compile(self) -> None:
        """Send the next waiting compile to the compile worker, if it is free.

        Sources of the guild the compile worker is bound to go first (no spare
        spent on a switch while they wait)."""
        q = self._compile_q
        while q:
            bound = self._compiler
            if (bound is not None and bound.alive and bound.req is None
                    and self._compiler_guild is not None and q[0][0][0] != self._compiler_guild):
                for i, item in enumerate(q):
                    if item[0][0] == self._compiler_guild:
                        del q[i]
                        q.appendleft(item)
                        break
            key, source, waiting = q[0]
            if waiting.get_loop() is not self._loop:
                # Queued on an event loop the pool has left (``Pool.attach``): dropped.
                q.popleft()
                self._compiles.pop(key, None)
                self._for_cache.discard(key)
                continue
            w = self._compile_worker(key[0])
            if w is None:
                if not self._zygote_alive:
                    # No spare can come: those requests go on without code.
                    while q:
                        self._compile_done(q.popleft(), None)
                    return
                # No compile worker for this guild now: whoever waits goes on
                # without code (its worker compiles, and offers the code if it
                # never ran a script). A long source stays queued for the cache
                # until a spare is ready (``_on_message``: ready); a short one is
                # dropped, as when the compile worker is busy (``_await_code``):
                # otherwise a spare ready before the worker's offer compiled it twice.
                if len(source) <= OFFERED_SOURCE_CHARS:
                    self._compile_done(q.popleft(), None, counted=False)
                    continue
                if not waiting.done():
                    waiting.set_result(None)
                return
            if w.req is not None:
                return   # busy: its answer sends the next one
            assert self._loop is not None
            w.sent += 1
            req = RequestState(self._loop.create_future(), "compile", None, {},
                               Limits(COMPILE_BUDGET_MS, COMPILE_MEMORY_BYTES >> 10))
            req.id = w.sent
            req.t0 = self._loop.time()
            req.deadline = req.t0 + COMPILE_BUDGET_MS / 1000.0 + self.kill_grace
            req.worker = w
            item = q.popleft()
            self._compiling_now = key
            self._compiler_guild = key[0]
            req.future.add_done_callback(functools.partial(self._compile_answered, item, req.t0))
            w.req = req
            self._watched[w] = None
            self._busy += 1
            self._ensure_tick()
            if w.send(w.compile_frame(req.id, source), self._loop, self._on_writable):
                return
            w.req = None
            self._busy -= 1
            self._worker_lost(w)   # resolves nothing (no request now); next worker next turn
            q.appendleft(item)

    def _compile_answered(self, item: tuple[CodeKey, str, "asyncio.Future[Any]"],
                          sent: float, answer: "asyncio.Future[Any]") -> None:
        key = item[0]
        if key in self._for_cache and self._loop is not None:
            # Nobody held a run slot for it: the compile worker's time is the
            # guild's all the same (a request that joined it paid its wait too).
            if self._sched.charge(key[0], self._loop.time() - sent):
                self._fell_into_debt(key[0], key[1])
        self._compile_done(item, None if answer.cancelled() else answer.result())
        self._next_compile()

    def _compile_done(self, item: tuple[CodeKey, str, "asyncio.Future[Any]"], msg: Any,
                      counted: bool = True) -> None:
        """A compile came back (``msg``: the ``code`` message) or failed (anything else;
        not ``counted``: dropped, a worker compiled it)."""
        key, _, future = item
        self._compiles.pop(key, None)
        self._for_cache.discard(key)
        if self._compiling_now == key:
            self._compiling_now = None
        if type(msg) is dict and self._codes is not None:
            meta = msg["meta"]
            err = meta["err"]
            self._codes.put(key, msg["code"], tuple(meta["events"]), meta["endpoint"],
                            meta["gen"], (err[0], err[1]) if err is not None else None)
            self._c["compiles"] += 1
        elif counted:
            self._c["compile_failures"] += 1
        if not future.done():
            future.set_result(None)

    def _worker_compiled(self, req: RequestState, code: bytes, meta: dict[str, Any]) -> None:
        """A worker that has never run a script compiled the request's source and
        offers the code (``Inbox._on_message`` checks that): it goes into the cache
        under the request's guild (the worker is bound to it, as a compile worker is
        to the guild it compiles for), and a compile of the same version queued for
        the compile worker is dropped."""
        codes = self._codes
        if codes is None or len(code) > OFFER_PER_SOURCE_CHAR * len(req.ref.source) + (64 << 10):
            return   # far more code than its source makes: not kept (the cache is shared)
        key = (req.guild, req.ref.key, req.ref.version, req.dig)
        if key not in codes:
            codes.put(key, code, tuple(meta["events"]), meta["endpoint"], meta["gen"], None)
            self._c["worker_compiles"] += 1
        if key in self._compiles and key != self._compiling_now:
            for i, item in enumerate(self._compile_q):
                if item[0] == key:
                    del self._compile_q[i]
                    self._compile_done(item, None, counted=False)
                    break

    def _on_code(self, w: WorkerHandle, req: RequestState, msg: dict[str, Any]) -> bool:
        """The compile worker answered; True when it should be replaced."""
        w.req = None
        self._busy -= 1
        w.jobs += 1
        if self._loop is not None:
            w.busy_s += self._loop.time() - req.t0
        req.resolve(msg)
        return bool(msg["exit"]) or w.jobs >= w.max_jobs

