"""`Inbox`: what the pool does with each message a worker sends.

``ready`` (a spare joins), ``need`` (send the source again, once),
``compiled`` (the script's own clock starts), ``code`` (the compile worker's
answer, ``sandbox.compiling``), ``where`` (where a script was
when its time ran out, for the timeout's error record), ``res`` / ``xres``
(the answer: the request resolves and the worker is parked or replaced).
Anything else, or any of these out of turn, is a ``ProtocolError``: the
worker is killed (``Inbox._on_readable``).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from sandbox import protocol
from sandbox.budget import WORKER_BYTES
from sandbox.channel import WorkerHandle
from sandbox.compiling import Compiling
from sandbox.errors import ProtocolError
from sandbox.limits import COMPILE_BUDGET_MS, MAX_RSS_GROWTH_BYTES, RESTART_COST_S
from sandbox.outcome import failure, from_result
from sandbox.supervisor import Supervisor

log = logging.getLogger("sandbox.pool")


class Inbox(Compiling, Supervisor):
    """Worker messages, for ``Pool`` (which initialises the shared state)."""

    kill_grace: float
    _steps: dict[str, float]

    if TYPE_CHECKING:  # provided by Placement / Pool (before this class in the MRO)
        def _park(self, w: WorkerHandle, now: float) -> None: ...

        def _on_spare(self, w: WorkerHandle) -> None: ...

        def _on_writable(self, w: WorkerHandle) -> None: ...

    @property
    def spawn_steps(self) -> dict[str, float]:
        """Mean start-up cost of a worker in ms, per step, over the workers started so far:
        ``fork_call`` (the fork server's ``fork()``), ``fork`` (until the child runs),
        ``harden``, ``init`` (memory accountant and runner), ``total`` (spawn request to
        ready, as the pool saw it); ``n`` workers."""
        n = self._steps["n"]
        return {k: (v if k == "n" else v / n if n else 0.0) for k, v in self._steps.items()}

    def _count_steps(self, w: WorkerHandle, ms: dict[str, float] | None) -> None:
        """Add a new worker's start-up steps to ``Pool.spawn_steps``."""
        steps = self._steps
        steps["n"] += 1
        steps["fork_call"] += w.fork_ms
        steps["total"] += (time.monotonic() - w.asked_at) * 1000.0 if w.asked_at else 0.0
        for k, v in (ms or {}).items():
            steps[k] += v

    def _on_readable(self, w: WorkerHandle) -> bool:
        """Read what the worker sent and act on it; False when nothing was there."""
        try:
            data = w.sock.recv(65536)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            req, loop = w.req, self._loop
            if req is not None and loop is not None and loop.time() >= req.deadline:
                # Gone past its job's deadline (the CPU backstop ended a script
                # that ran on through a stall of the loop): the tick's verdict,
                # a time-out, not a crash counted towards the version's quarantine.
                self._timeout(w, req, loop.time())
            else:
                self._worker_lost(w)
            return True
        try:
            if w.req is None and w.ready:
                # A worker sends nothing between jobs: bytes now come from a
                # compromised one (a frame dribbled a byte at a time while idle
                # kept the service's loop busy: a review, session 30).
                raise ProtocolError("data from a worker between jobs")
            for msg in w.reader.feed(data):
                self._on_message(w, protocol.check_reply(msg))
                if not w.alive:
                    return True
        except ProtocolError as exc:
            log.error("sandbox worker %d sent an invalid frame (%s); killing it", w.pid, exc.message)
            self._c["crashes"] += 1
            if w.req is not None and self._loop is not None:
                self._note_crash(w.req, "sandbox worker sent an invalid reply", self._loop.time())
            self._replace(w, failure("crash", "sandbox worker sent an invalid reply",
                                     self._elapsed(w)), backoff=False)
        return True

    def _on_message(self, w: WorkerHandle, msg: dict[str, Any]) -> None:
        t = msg["t"]
        req = w.req
        if t == "ready":
            if w.ready:
                raise ProtocolError("second ready message")
            w.ready = True
            self._unready -= 1
            # From here on every CPU second it uses is looked at (housekeeping:
            # charged to its guild beyond the time it held requests); its
            # start-up and hardening before this are the pool's.
            w.idle_cpu = (0, 0.0, w.cpu_seconds())
            self._merge_hardening(msg["hard"], msg["notes"])
            self._count_steps(w, msg.get("ms"))
            if self._loop is not None:
                self._loop.call_later(1.0, self._clear_failures, w)
            self._on_spare(w)
            if self._compile_q and self._loop is not None:
                self._next_compile()   # a source may wait for a compile worker of its guild
            return
        if req is None or msg["id"] != req.id:
            raise ProtocolError(f"unexpected {t!r} message")
        if t == "where":
            # Only the first report of a job counts, and it changes no deadline.
            if req.kind != "job" or req.where is not None:
                raise ProtocolError("unexpected where message")
            req.where = (msg["line"], msg["tb"])
            return
        if t == "compiled":
            if req.kind != "job" or not req.ships_source:
                raise ProtocolError("worker compiled a source it was not sent")
            req.ships_source = False
            req.compiled = True
            if "code" in msg:
                # Offered only by a worker that never ran a script: it has seen
                # nothing but compiler input, as a compile worker bound to the
                # job's guild (a worker that ran one could have been taken over).
                # Once per worker, with the "compiled" of its first job (a "need"
                # after "compiled" is refused above, so no script ran before it).
                if w.jobs or w.offered:
                    raise ProtocolError("worker that may have run a script offered code")
                w.offered = True
                self._worker_compiled(req, msg["code"], msg["meta"])
            assert self._loop is not None
            req.deadline = self._loop.time() + req.limits.time_ms / 1000.0 + self.kill_grace
            return
        if t == "need":
            # Legitimate once, and only when the job went without the source:
            # a compromised worker answering "need" again and again (or after
            # "compiled") would reset its deadline to a new compile budget
            # each time and hold the request and the slot for ever (R10).
            if (req.kind != "job" or req.sent_script or req.ships_source or req.asked_source
                    or req.compiled):
                raise ProtocolError("worker asked again for a source it was sent")
            req.asked_source = True
            w.known.pop((req.ref.key, req.ref.version, req.dig), None)
            if req.kind != "job" or not w.send(w.job_frame(req, self._codes), self._loop,
                                               self._on_writable):
                raise ProtocolError("worker asked for a source it cannot have")
            assert self._loop is not None
            req.deadline = self._loop.time() + COMPILE_BUDGET_MS / 1000.0 + self.kill_grace
            return
        if t == "code":
            if req.kind != "compile":
                raise ProtocolError("code answers a job")
            if self._on_code(w, req, msg):
                self._replace(w, None, backoff=False)
            return
        if (t == "res") != (req.kind == "job"):
            raise ProtocolError(f"{t!r} answers a {req.kind!r} request")
        if req.where is not None and self._loop is not None and self._loop.time() >= req.deadline:
            # Read only after its deadline (the loop stalled), from a script the
            # worker's timer saw run past its limit: the time-out it would have had.
            self._timeout(w, req, self._loop.time())
            return
        w.req = None
        self._busy -= 1
        w.jobs += 1
        loop = self._loop
        assert loop is not None
        now = loop.time()
        w.busy_s += now - req.t0
        if t == "xres":
            self._end(req, now - req.t0)
            req.resolve((msg["ok"], msg.get("value")))
            self._replace(w, None, backoff=False)  # hooks may have changed it
            return
        if msg["over"]:
            self._c["memory_kills"] += 1
        rss = msg.get("rss")
        if rss:
            if not w.rss_first:
                w.rss_first = rss
            w.rss_last = rss
            if rss - w.rss_first >= WORKER_BYTES:
                self._growers[w] = None   # retired first to make room (Placement._top_up)
            elif self._growers:
                self._growers.pop(w, None)
        # A worker retires itself past MAX_RSS_GROWTH_BYTES above its start-up
        # size (below its first report): one that reports more growth and stays
        # is lying or broken, and is replaced, so its charge against the memory
        # budget (what it may make the pool retire) stays bounded.
        grown_past = w.rss_last - w.rss_first > MAX_RSS_GROWTH_BYTES
        retires = msg["exit"] or msg["over"] or grown_past
        self._end(req, now - req.t0 + (RESTART_COST_S if retires else 0.0))
        req.resolve(from_result(msg["r"], msg["dur"], msg["peak"], req.waited,
                                req.deprioritised))
        if retires or w.jobs >= w.max_jobs:
            self._replace(w, None, backoff=False)
        else:
            self._park(w, now)
            self._pump()
