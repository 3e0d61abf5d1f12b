"""Service-side handles: one per worker channel, one per request in flight.

A :class:`WorkerHandle` owns the service's end of a worker's socketpair, the
worker's pidfd (signals through it cannot hit a recycled pid), the frame
reader, the write backlog and the mirror of the worker's compile cache (so a
script version's source is sent to each worker once).
"""
from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import psutil  # type: ignore[import-untyped,unused-ignore]

from sandbox import protocol

if TYPE_CHECKING:
    from sandbox.codecache import CodeCache
    from sandbox.limits import Limits


PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def process_cpu_clock(pid: int) -> int:
    """The clock id of process ``pid``'s CPU time (what ``clock_getcpuclockid(3)``
    gives: Linux encodes the pid, ``CPUCLOCK_SCHED``)."""
    return ((~pid) << 3) | 2


def readable(fds: list[Any], timeout: float) -> list[Any]:
    """The objects of ``fds`` (ints or objects with ``fileno()``) readable
    within ``timeout`` seconds.  poll(), not select(): a pool of thousands of
    workers holds descriptors past select()'s limit of 1024."""
    poller = select.poll()
    by_fd = {}
    for f in fds:
        fd = f if isinstance(f, int) else f.fileno()
        by_fd[fd] = f
        poller.register(fd, select.POLLIN)
    return [by_fd[fd] for fd, _ in poller.poll(max(0, int(timeout * 1000)))]


@dataclass(frozen=True, slots=True)
class ScriptRef:
    """Which script version to run; ``source`` is shipped only to workers lacking it."""

    key: str
    version: int
    source: str

    def __post_init__(self) -> None:
        # Checked here, in the service, so a wrong type is the caller's error
        # and never a protocol error that costs a worker.
        if type(self.key) is not str or type(self.version) is not int or type(self.source) is not str:
            raise TypeError("ScriptRef needs key: str, version: int, source: str")


class RequestState:
    """One ``pool.run`` call: its future, what to run and its deadline."""

    __slots__ = ("future", "kind", "ref", "event", "limits", "id", "t0", "deadline", "worker",
                 "ships_source", "compiled", "asked_source", "guild", "queued", "deprioritised", "waited",
                 "seated", "excess", "where", "dig", "code_waited", "homeless", "cpu_at_ship",
                 "held_s", "sent_script")

    def __init__(self, future: "asyncio.Future[Any]", kind: str, ref: Any,
                 event: dict[str, Any], limits: "Limits", guild: str = "") -> None:
        self.future = future
        self.guild = guild        # the tenant: only workers bound to it may run this
        self.queued = False       # in the scheduler's queue now
        self.waited = False       # was queued at some point
        self.deprioritised = False  # queued while its guild was over its budget
        self.seated = False       # holds one of the scheduler's run slots
        self.homeless = False     # waits, holding no slot, for its guild's first worker
        self.excess = False       # ... beyond its guild's fair share (sandbox.scheduler)
        #: (line, script traceback) the worker reported when the time limit passed
        self.where: tuple[int | None, str] | None = None
        self.kind = kind  # "job", or "exec" for the test hook
        self.ref = ref
        self.event = event
        self.limits = limits
        self.id = 0
        self.t0 = 0.0
        self.deadline = 0.0
        self.worker: WorkerHandle | None = None
        self.ships_source = False  # the worker compiles first: see limits.COMPILE_BUDGET_MS
        self.cpu_at_ship = 0.0     # the worker's CPU seconds when the source was sent
        self.compiled = False      # it said "compiled": the script may have run since
        # A worker may ask for the source ("need") once per request: each ask
        # resets the deadline to a fresh compile budget (redteam finding R10).
        self.asked_source = False
        #: The job's frame carried the script (source, and code when cached): a
        #: "need" for it then is a lie, and one sent after the script ran (code
        #: shipped: no "compiled" comes first) would have a taken-over worker
        #: sent the source to compile and offer its own code for (review, session 25).
        self.sent_script = False
        self.dig = b""  # SHA-256 of ref.source (sandbox.codecache.source_digest)
        self.code_waited = False  # waited once for the compile worker (sandbox.compiling)
        #: Time it held its run slot before its job went out (waiting for the
        #: compile worker): charged to its guild with the job's own.
        self.held_s = 0.0

    def resolve(self, value: Any) -> None:
        """Set the result unless the caller already went away (cancelled)."""
        if not self.future.done():
            self.future.set_result(value)


class WorkerHandle:
    """The service's view of one worker process."""

    __slots__ = ("slot", "pid", "pidfd", "sock", "fd", "reader", "known", "cache_size", "jobs",
                 "max_jobs", "spawned_at", "ready", "req", "alive", "outbuf", "guild",
                 "idle_since", "asked_at", "fork_ms", "rss_first", "rss_last", "offered",
                 "idle_cpu", "sent", "busy_s")

    def __init__(self, slot: int, pid: int, channel_fd: int, pidfd: int, *, cache_size: int,
                 max_jobs: int, now: float) -> None:
        self.slot = slot
        self.pid = pid
        self.pidfd = pidfd
        self.sock = socket.socket(fileno=channel_fd)
        self.sock.setblocking(False)
        self.fd = channel_fd
        self.reader = protocol.FrameReader(protocol.MAX_REPLY_BYTES, bounded=True)
        self.known: OrderedDict[tuple[str, int, bytes], None] = OrderedDict()
        self.cache_size = cache_size
        self.jobs = 0
        self.max_jobs = max_jobs
        self.spawned_at = now
        self.ready = False
        self.req: RequestState | None = None
        self.alive = True
        self.outbuf: bytearray | None = None
        # None: a spare that has run nobody's code; else the one guild it may
        # ever serve (bound at its first job, until it exits).
        self.guild: str | None = None
        self.idle_since = now
        self.asked_at = 0.0   # time.monotonic() of the spawn request (start-up cost)
        self.fork_ms = 0.0    # the fork server's fork() call
        # Resident bytes the worker reported after its first and its last job
        # (0: none yet); what it grew between them counts against the pool's
        # memory budget (sandbox.placement).
        self.rss_first = 0
        self.rss_last = 0
        self.offered = False   # it offered compiled code (once at most, sandbox.compiling)
        #: (jobs done, `busy_s`, CPU seconds) when housekeeping last looked at it idle.
        self.idle_cpu: tuple[int, float, float] | None = None
        #: Wall seconds it held requests (jobs, compiles), each from its dispatch
        #: to its answer: a single-threaded process uses at most that much CPU
        #: on them, so CPU beyond it was used between requests.
        self.busy_s = 0.0
        #: Requests sent to it: each one's id (a count of this worker's own, so
        #: the ids tell it nothing of other guilds' traffic, as one pool-wide
        #: counter did: review, session 30).
        self.sent = 0

    def job_frame(self, req: RequestState, codes: "CodeCache | None" = None) -> bytes:
        """Encode ``req`` for this worker; the script goes along only if it lacks it:
        as marshalled code from ``codes`` (checked there) when it has code compiled
        for ``req``'s guild, else as
        source for the worker to compile (``req.ships_source``).

        Raises ProtocolError when the frame would pass the job cap.
        """
        if req.kind == "exec":
            return protocol.encode({"t": "exec", "id": req.id, "code": req.event["code"]},
                                   protocol.MAX_JOB_BYTES)
        ref = req.ref
        key = (ref.key, ref.version, req.dig)
        known = self.known
        have = key in known
        # The code cache's key names the guild (never another guild's code).
        entry = None if have or codes is None else codes.get((req.guild, *key))
        req.ships_source = not have and entry is None
        req.sent_script = not have
        if req.ships_source:   # (once per version and worker: the compile's CPU is what follows)
            req.cpu_at_ship = self.cpu_seconds()
        frame = protocol.encode(
            {"t": "job", "id": req.id, "key": ref.key, "ver": ref.version, "dig": req.dig,
             "src": None if have else ref.source,
             "code": entry.code if entry is not None else None,
             "meta": entry.meta() if entry is not None else None, "event": req.event,
             "ms": req.limits.time_ms, "mem": req.limits.memory_kb * 1024,
             # The supervisor's deadline counts from after this (``Pool._dispatch``).
             "until": time.monotonic() + req.limits.time_ms / 1000.0},
            protocol.MAX_JOB_BYTES)
        # Same order of moves and evictions as the worker's LRU.
        if have:
            known.move_to_end(key)
        else:
            known[key] = None
            if len(known) > self.cache_size:
                known.popitem(last=False)
        return frame

    def compile_frame(self, job_id: int, source: str) -> bytes:
        """A ``compile`` message for the compile worker (``sandbox.compiling``)."""
        return protocol.encode({"t": "compile", "id": job_id, "src": source},
                               protocol.MAX_JOB_BYTES)

    def send(self, frame: bytes, loop: asyncio.AbstractEventLoop | None,
             on_writable: Callable[["WorkerHandle"], None]) -> bool:
        """Write without blocking, keeping any rest for the writer callback; False if dead."""
        if self.outbuf is not None:
            self.outbuf += frame
            return True
        try:
            n = self.sock.send(frame)
        except BlockingIOError:
            n = 0
        except OSError:
            return False
        if n < len(frame):
            assert loop is not None
            self.outbuf = bytearray(memoryview(frame)[n:])
            loop.add_writer(self.fd, on_writable, self)
        return True

    def flush(self, loop: asyncio.AbstractEventLoop | None) -> bool:
        """Continue a partial write; False if the channel is dead."""
        if self.outbuf is None:
            return True
        try:
            n = self.sock.send(self.outbuf)
        except BlockingIOError:
            return True
        except OSError:
            return False
        del self.outbuf[:n]
        if not self.outbuf:
            self.outbuf = None
            if loop is not None:
                loop.remove_writer(self.fd)
        return True

    def signal(self, signum: int) -> None:
        """Signal the worker through its pidfd (safe against pid reuse)."""
        try:
            if self.pidfd >= 0:
                signal.pidfd_send_signal(self.pidfd, signum)
            elif self.alive:  # no pidfd on this kernel: plain kill while we own the pid
                os.kill(self.pid, signum)
        except (ProcessLookupError, OSError):
            pass

    def exited(self) -> bool:
        """True once the process is gone (its pidfd turns readable)."""
        if self.pidfd < 0:
            return not psutil.pid_exists(self.pid)
        return bool(readable([self.pidfd], 0))

    def close(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Drop the channel: a late reply can never be read after this."""
        self.alive = False
        if loop is not None:
            loop.remove_reader(self.fd)
            if self.outbuf is not None:
                loop.remove_writer(self.fd)
        self.outbuf = None
        self.sock.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

    def rss(self) -> int:
        """Resident set size in bytes (0 if it cannot be read)."""
        try:
            with open(f"/proc/{self.pid}/statm", "rb") as f:
                return int(f.read().split()[1]) * PAGE_BYTES
        except (OSError, ValueError, IndexError):
            return 0

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the worker has used (0.0 if it cannot be read):
        its process CPU clock, one system call (read for each job that ships a
        source, so at least once per new worker)."""
        try:
            return time.clock_gettime(process_cpu_clock(self.pid))
        except OSError:
            return 0.0
