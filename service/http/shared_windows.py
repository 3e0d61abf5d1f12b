"""Rate-limit windows shared by the front processes of one node (`server.processes` > 1).

The moving windows of `service.http.ratelimit` (per-endpoint quotas, the
failed-secret throttle, the admin API's per-token limit) live in one shared
memory mapping that the arbiter creates before it forks the fronts, so a limit
of 30 per minute admits 30 whichever front the requests land on. Each call is
a few array reads and writes under a process-shared, robust pthread mutex in
the mapping (no system call unless contended): when a front dies holding it (a
SIGKILL mid-update) the next locker is told so and takes it over, where a plain
semaphore would stay locked forever. A record half-updated at that moment can
miscount that one key's window until it slides.

Layout: an open-addressing table of `slots` keys (Python's `hash` of the key,
the same in every front because they are all forked from the arbiter), each
with a ring of `ring` records (first hit time, last hit time, hits). A limit
of at most `ring` keeps one record per hit: the same exact window as the
in-memory deque. A larger limit merges hits less than `60 / ring` seconds
apart into one record, which leaves the window when its last hit does: never
more than the limit in any 60 s, a slot freed at most `60 / ring` s late.

A key that finds no slot (more live keys in its probe run than `PROBE`, e.g.
a flood of failed secrets from very many addresses) is counted in this
front's own memory instead, against its share of the limit (the limit
divided by the number of fronts, rounded down, at least 1), and counts as
used up once this front's share is (so the failed-secret throttle engages
whether or not the number of fronts divides its 20). Whichever fronts its
requests land on, the fronts together admit at most the limit (or one per
front, if there are more fronts than that) while it has no slot, and at
most the limit more once it gets one (its fronts' memory is not carried
into the slot), where counting the whole limit in each front admitted the
number of fronts times it. Such a key may be admitted less than its limit while the
table stays full (a front whose share is used up refuses it even if the
others admitted none).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import time
from collections.abc import Callable

from service.http.memory_windows import WINDOW_S, MemoryWindows, Stamp

#: Slots examined for a key before it falls back to the front's own memory.
PROBE = 16
#: Bytes reserved for the mutex (a pthread_mutex_t is 40 on x86-64, 48 on arm64).
MUTEX_BYTES = 128
_PROCESS_SHARED = 1  # PTHREAD_PROCESS_SHARED
_ROBUST = 1          # PTHREAD_MUTEX_ROBUST


class _RobustMutex:
    """A process-shared robust pthread mutex at the start of a shared mapping."""

    def __init__(self, mapping: mmap.mmap) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._ptr = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(mapping)))
        self._lock, self._unlock = libc.pthread_mutex_lock, libc.pthread_mutex_unlock
        self._consistent = libc.pthread_mutex_consistent
        for fn in (self._lock, self._unlock, self._consistent):
            fn.argtypes = [ctypes.c_void_p]
            fn.restype = ctypes.c_int
        attr = ctypes.create_string_buffer(64)  # pthread_mutexattr_t: 4 bytes on Linux
        if (libc.pthread_mutexattr_init(attr) or libc.pthread_mutexattr_setpshared(attr, _PROCESS_SHARED)
                or libc.pthread_mutexattr_setrobust(attr, _ROBUST)
                or libc.pthread_mutex_init(self._ptr, attr)):
            raise OSError("cannot create a process-shared robust mutex")

    def acquire(self) -> None:
        if self._lock(self._ptr) == errno.EOWNERDEAD:  # its holder died: ours now
            self._consistent(self._ptr)

    def release(self) -> None:
        self._unlock(self._ptr)


class SharedWindows(MemoryWindows):
    """Moving windows in a shared mapping; the `MemoryWindows` interface, usable in any front."""

    def __init__(self, slots: int = 16384, ring: int = 64,
                 clock: Callable[[], float] = time.time, fronts: int = 1) -> None:
        """Create the mapping (call in the arbiter, before forking the fronts).
        `fronts`: how many processes share it (a key without a slot gets that
        share of its limit in each).

        Raises `OSError` where no process-shared robust mutex can be made."""
        super().__init__(clock)
        self._fronts = max(1, fronts)
        if slots & (slots - 1):
            raise ValueError("slots must be a power of two")
        self._slots, self._ring = slots, ring
        sizes = (MUTEX_BYTES, 8 * slots, 8 * 3 * slots, 8 * slots * ring, 8 * slots * ring,
                 8 * slots * ring)
        self._map = mmap.mmap(-1, sum(sizes), mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE)
        view = memoryview(self._map)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        parts = [view[o:o + n] for o, n in zip(offsets, sizes)]
        self._keys = parts[1].cast("q")    # hash of the key; 0: never used
        self._meta = parts[2].cast("q")    # per slot: head record, records, hits
        self._first = parts[3].cast("d")   # per record: first hit time
        self._last = parts[4].cast("d")    # per record: last hit time
        self._count = parts[5].cast("q")   # per record: hits
        self._mutex = _RobustMutex(self._map)

    # -------------------------------------------------------------- table

    def _find(self, key: str, now: float, create: bool) -> int:
        """The slot of `key`; a free or expired one if `create`; -1 if none."""
        h = hash(key) or 1
        mask = self._slots - 1
        keys, meta, last = self._keys, self._meta, self._last
        reusable = -1
        i = h & mask
        for _ in range(PROBE):
            k = keys[i]
            if k == h:
                return i
            if k == 0:
                if reusable < 0:
                    reusable = i
                break  # slots are reused, never emptied: nothing of `key` lies further
            if reusable < 0 and create:
                n = meta[3 * i + 1]
                newest = (meta[3 * i] + n - 1) % self._ring
                if n == 0 or last[i * self._ring + newest] <= now - WINDOW_S:
                    reusable = i
            i = (i + 1) & mask
        if not create or reusable < 0:
            return -1
        keys[reusable] = h
        meta[3 * reusable] = meta[3 * reusable + 1] = meta[3 * reusable + 2] = 0
        return reusable

    def _expire(self, slot: int, now: float) -> tuple[int, int, int]:
        """Drop the records that left the window: (head, records, hits) after it."""
        meta, last, count = self._meta, self._last, self._count
        m = 3 * slot
        head, n, total = meta[m], meta[m + 1], meta[m + 2]
        if n:
            ring = self._ring
            base = slot * ring
            edge = now - WINDOW_S
            if last[base + head] <= edge:
                while n and last[base + head] <= edge:
                    total -= count[base + head]
                    head = (head + 1) % ring
                    n -= 1
                meta[m], meta[m + 1], meta[m + 2] = head, n, total
        return head, n, total

    # ------------------------------------------------- a key without a slot

    def _share(self, limit: int) -> int:
        """What one front admits of a key without a slot: the limit divided by
        the fronts, rounded down, and at least 1 (a share of 0 refused every
        request of a limit below the number of fronts, and counted no failed
        secret at all)."""
        return max(1, limit // self._fronts) if limit > 0 else 0

    def _node_count(self, limit: int, share: int, count: int) -> int:
        """What the node may have admitted of a key without a slot, as one
        front counted `count`: every front as many, and the whole limit once
        this front's share is used (so a throttle engages however the limit
        divides among the fronts)."""
        return limit if count >= share else min(limit, count * self._fronts)

    # ------------------------------------------- the MemoryWindows interface

    def hit(self, key: str, limit: int) -> tuple[bool, int, float, Stamp]:
        """Count a hit if a slot is free: (allowed, hits in window, oldest hit
        time, the hit's own stamp or None)."""
        self._mutex.acquire()
        try:
            now = self._clock()
            slot = self._find(key, now, create=True)
            if slot < 0:   # this front's share, so that all of them admit about the limit at most
                share = self._share(limit)
                allowed, count, oldest, stamp = super().hit(key, share)
                return allowed, self._node_count(limit, share, count), oldest, stamp
            head, n, total = self._expire(slot, now)
            ring = self._ring
            base = slot * ring
            if total < limit:
                newest = base + (head + n - 1) % ring
                if n and limit > ring and (n == ring or now - self._first[newest] < WINDOW_S / ring):
                    self._last[newest] = now
                    self._count[newest] += 1
                else:  # n < ring here: total < limit <= ring, or a record is free
                    record = base + (head + n) % ring
                    self._first[record] = self._last[record] = now
                    self._count[record] = 1
                    n += 1
                    self._meta[3 * slot + 1] = n
                total += 1
                self._meta[3 * slot + 2] = total
                return True, total, self._last[base + head], now
            return False, total, self._last[base + head] if n else now, None
        finally:
            self._mutex.release()

    def peek(self, key: str, limit: int) -> tuple[int, float]:
        self._mutex.acquire()
        try:
            now = self._clock()
            slot = self._find(key, now, create=False)
            if slot < 0:   # as `hit` counts it: every front as many as this one
                share = self._share(limit)
                count, oldest = super().peek(key, share)
                return self._node_count(limit, share, count), oldest
            head, n, total = self._expire(slot, now)
            return total, self._last[slot * self._ring + head] if n else now
        finally:
            self._mutex.release()

    def refund(self, key: str, limit: int, stamp: Stamp) -> None:
        """Take back the hit of ``key`` that `hit` stamped ``stamp``: one hit
        of the record whose times hold it (nothing if it left the window, or
        if the key had no slot then and has one now). A record left with no
        hit leaves the ring, the newer ones moving down one place."""
        if not isinstance(stamp, float):
            return
        self._mutex.acquire()
        try:
            slot = self._find(key, self._clock(), create=False)
            if slot < 0:
                super().refund(key, limit, stamp)
                return
            meta, ring, first, last, count = self._meta, self._ring, self._first, self._last, self._count
            head, n, total = meta[3 * slot], meta[3 * slot + 1], meta[3 * slot + 2]
            base = slot * ring
            for back in range(n - 1, -1, -1):   # from the newest: a refund follows its hit closely
                record = base + (head + back) % ring
                if last[record] < stamp:
                    return          # older than every record that could hold it
                if first[record] <= stamp:
                    count[record] -= 1
                    meta[3 * slot + 2] = total - 1
                    if count[record] <= 0:
                        for later in range(back, n - 1):
                            to, frm = base + (head + later) % ring, base + (head + later + 1) % ring
                            first[to], last[to], count[to] = first[frm], last[frm], count[frm]
                        meta[3 * slot + 1] = n - 1
                    return
        finally:
            self._mutex.release()
