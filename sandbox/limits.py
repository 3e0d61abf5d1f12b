"""Per-worker resource limits: rlimits, the CPU backstop and memory accounting.

The supervisor's wall-clock SIGKILL is the real time limit. Memory is counted
in layers: ``_memguard`` counts every allocation of Python's allocators and
refuses the one past the cap (the precise, fast answer); a per-job RLIMIT_AS
(:class:`AddressSpaceLimit`) bounds what other allocators map (OpenSSL,
libc); the resident size a worker keeps after a job (:class:`ProcessMemory`)
retires it past a bound. Everything here runs in a worker (or the one-shot
compile process) after fork, never in the service process.
"""
from __future__ import annotations

import os
import resource
import time
import tracemalloc
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol


_memguard: ModuleType | None
try:  # the optional C extension; see setup.py
    import sandbox._memguard as _memguard
except ImportError:  # pragma: no cover - exercised only where it cannot be built
    _memguard = None

MEMGUARD_AVAILABLE: bool = _memguard is not None


@dataclass(frozen=True)
class Limits:
    """What one invocation may use: wall-clock milliseconds and script memory in KiB."""

    time_ms: int = 1000
    memory_kb: int = 512

    def __post_init__(self) -> None:
        if type(self.time_ms) is not int or not 1 <= self.time_ms <= 600_000:
            raise ValueError("time_ms must be an int between 1 and 600000")
        if type(self.memory_kb) is not int or not 16 <= self.memory_kb <= 1024 * 1024:
            raise ValueError("memory_kb must be an int between 16 and 1048576")


_statm: tuple[int, int] | None = None   # (pid, descriptor of its /proc/self/statm)


def statm_pages() -> tuple[int, int]:
    """Pages this process maps and keeps resident (``/proc/self/statm``).

    Read through one descriptor per process, opened at the first call: a
    worker opens it while it hardens, before Landlock leaves it no way to
    open a file (``sandbox.landlock``); a child re-opens its own."""
    global _statm
    pid = os.getpid()
    if _statm is None or _statm[0] != pid:
        _statm = (pid, os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC))
    size, rss = os.pread(_statm[1], 128, 0).split()[:2]
    return int(size), int(rss)


def current_address_space() -> int:
    """Bytes of virtual address space this process maps now (from /proc)."""
    return statm_pages()[0] * resource.getpagesize()


def apply_rlimits(*, address_space: int, cpu_lifetime_s: int, nofile: int,
                  cpu_soft_s: int | None = None) -> list[str]:
    """Set AS, CPU, NOFILE, FSIZE=0 and CORE=0; returns the names that could not be set.

    RLIMIT_CPU's soft limit starts at ``cpu_soft_s`` (default
    `CpuBackstop.WINDOW_S`, which a worker moves forward before each job); the
    hard limit bounds a worker's whole life (it is then recycled). A one-shot
    process that never re-arms passes its whole allowance as ``cpu_soft_s``.
    No SIGXCPU handler is installed: its default action ends the process even
    while it sits inside one long C call.
    """
    failed: list[str] = []
    plan = [
        ("AS", resource.RLIMIT_AS, (address_space, address_space)),
        ("CPU", resource.RLIMIT_CPU,
         (CpuBackstop.WINDOW_S if cpu_soft_s is None else cpu_soft_s, cpu_lifetime_s)),
        ("NOFILE", resource.RLIMIT_NOFILE, (nofile, nofile)),
        ("FSIZE", resource.RLIMIT_FSIZE, (0, 0)),
        ("CORE", resource.RLIMIT_CORE, (0, 0)),
    ]
    for name, which, value in plan:
        try:
            resource.setrlimit(which, value)
        except (ValueError, OSError):
            failed.append(name)
    return failed


def forbid_new_processes() -> bool:
    """RLIMIT_NPROC=0: no fork or thread; meaningful only after the uid drop."""
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
        return True
    except (ValueError, OSError):
        return False


#: Wall-clock time a worker may spend compiling a script version it has not
#: seen, before the script's own time limit starts: twice the save-time CPU
#: budget, as only sources that compiled within COMPILE_CPU_BUDGET_S at save
#: time reach a worker (sandbox.compile_gate) and a busy host stretches wall time.
COMPILE_BUDGET_MS = 10_000
#: CPU time a source may take to compile at save time. A 250 KB script of
#: ordinary functions takes 0.6-1 s on one 2-core host and 1.4-1.9 s on
#: another (both idle), and on a virtual machine whose neighbours are busy
#: its CPU time was measured over 3 s; 5 s keeps such a script saveable, and
#: a compile bomb is still refused (it would take 10-20 s).
COMPILE_CPU_BUDGET_S = 5.0
#: Memory a compile may allocate (the guard's cap while compiling, in the
#: worker and at save time); the largest source the compiler accepts (100,000
#: tokens) peaks near 60 MB.
COMPILE_MEMORY_BYTES = 96 << 20
#: Address space a job may add beyond twice its memory cap: what Python's
#: allocators do not count (OpenSSL's and libc's mallocs, the guard's own
#: table, arena rounding) cannot pass the cap by more than this.
AS_SLACK_BYTES = 16 << 20
#: Resident memory a worker may keep beyond its size at start-up; past it the
#: worker retires after the job (caches a guild's scripts filled, fragments).
MAX_RSS_GROWTH_BYTES = 64 << 20
#: Worker-seconds a job is charged on top of its run time when its worker must
#: go because of it (a memory kill, a time-out, a crash, script code left in a
#: library cache, memory kept): about what starting the replacement costs
#: (fork, hardening, first job: 4-6 ms of CPU, ~10 ms of wall time measured on
#: 2-core hosts), so a guild that retires its worker every time pays for the
#: pool's forks from its own budget.
RESTART_COST_S = 0.010


class ProcessMemory:
    """This process's mapped and resident bytes, read at every ``refresh``.

    One ``pread`` of the descriptor `statm_pages` keeps (~1.3 µs; getrusage's
    high-water mark costs ~0.8 µs). Reading only when the high-water mark
    rose (as before) left both stale after one large passing peak: memory
    kept later stayed unmeasured below it (a worker kept 73 MB past its
    64 MB bound) and the next job's address-space bound started from an old
    size, refusing an honest job.
    """

    def __init__(self) -> None:
        self._page = resource.getpagesize()
        self.mapped = 0
        self.resident = 0
        self.refresh()

    def refresh(self) -> None:
        """Re-read the sizes."""
        size, rss = statm_pages()
        self.mapped, self.resident = size * self._page, rss * self._page


class AddressSpaceLimit:
    """Moves RLIMIT_AS's soft limit per job, under the worker's hard limit.

    Memory no Python allocator sees (OpenSSL's objects behind ``hmac`` and
    ``hashlib``, the compiler's) is bounded by the address space a job may
    map: what the worker maps when the job starts, plus twice the job's cap
    plus :data:`AS_SLACK_BYTES`. The bound stays until the next job's (so a
    worker serving the same cap from the same size makes no system call),
    unless the next frame needs more room to be read and decoded than it
    leaves (``make_room``): the job's event is the caller's data, decoded
    before any script runs, never held to the last job's bound.
    """

    def __init__(self) -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        self._hard = hard
        self._soft = soft
        self.active = hard != resource.RLIM_INFINITY

    def bound(self, mapped_now: int, cap_bytes: int) -> None:
        """Allow ``2 * cap_bytes + AS_SLACK_BYTES`` more than ``mapped_now``."""
        if self.active:
            self._set(min(mapped_now + 2 * cap_bytes + AS_SLACK_BYTES, self._hard))

    def release(self) -> None:
        """Back to the worker's own (hard) limit."""
        if self.active:
            self._set(self._hard)

    def make_room(self, mapped_now: int, needed: int) -> None:
        """Back to the worker's own limit if the bound in force leaves less than
        ``needed`` bytes above ``mapped_now`` (one system call, only then)."""
        if self.active and self._soft != self._hard and self._soft - mapped_now < needed:
            self._set(self._hard)

    def _set(self, soft: int) -> None:
        if soft != self._soft:
            resource.setrlimit(resource.RLIMIT_AS, (soft, self._hard))
            self._soft = soft


class CpuBackstop:
    """Keeps RLIMIT_CPU's soft limit a few seconds ahead of the CPU time used.

    A job cannot use more than ``limit + WINDOW_S`` seconds of CPU before the
    kernel's SIGXCPU ends the worker, even if the supervisor never kills it.
    Re-arming costs a setrlimit only once per second of CPU used, not per job.
    """

    WINDOW_S = 2

    def __init__(self, hard_s: int) -> None:
        self._hard = hard_s
        self._soft = float(self.WINDOW_S)

    def before_job(self, time_ms: int) -> bool:
        """Re-arm when needed; False when the worker's lifetime CPU is nearly spent."""
        used = time.process_time()
        need = used + time_ms / 1000.0 + 1.0
        if need <= self._soft:
            return True
        soft = int(used + time_ms / 1000.0) + self.WINDOW_S + 1
        if soft >= self._hard:
            return False
        resource.setrlimit(resource.RLIMIT_CPU, (soft, self._hard))
        self._soft = float(soft)
        return True


class MemoryAccountant(Protocol):
    """Counts the memory one invocation allocates."""

    name: str
    enforcing: bool

    def arm(self, cap_bytes: int) -> None: ...

    def disarm(self) -> tuple[int, bool]: ...


class GuardAccountant:
    """``_memguard``: refuses the allocation that would pass the cap, while it runs."""

    name = "memguard"
    enforcing = True

    def __init__(self) -> None:
        assert _memguard is not None
        _memguard.install()
        self._arm = _memguard.arm
        self._disarm = _memguard.disarm

    def arm(self, cap_bytes: int) -> None:
        self._arm(cap_bytes)

    def disarm(self) -> tuple[int, bool]:
        peak, exceeded = self._disarm()
        return int(peak), bool(exceeded)


class TraceAccountant:
    """tracemalloc fallback: measures the peak and judges it after the run.

    It cannot stop a growing loop while it runs; RLIMIT_AS does that, late.
    """

    name = "tracemalloc"
    enforcing = False

    def __init__(self) -> None:
        self._cap = 0

    def arm(self, cap_bytes: int) -> None:
        self._cap = cap_bytes
        tracemalloc.start(1)

    def disarm(self) -> tuple[int, bool]:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return peak, peak > self._cap


def make_accountant(prefer_guard: bool = True) -> MemoryAccountant:
    """The best accountant this build has."""
    if prefer_guard and MEMGUARD_AVAILABLE:
        return GuardAccountant()
    return TraceAccountant()
