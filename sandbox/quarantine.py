"""Crash quarantine: a script version that keeps crashing its worker runs no more, for a while.

A script version that crashed its worker ``crash_limit`` times within
``crash_window_s`` (per guild) is answered ``crash`` without a worker for
``quarantine_s``; the crashed worker's slot is refilled at once
(``sandbox.placement``). Mixed into ``Pool``, which initialises the state.
"""
from __future__ import annotations

import logging
from collections import deque

from sandbox.channel import RequestState
from sandbox.outcome import Outcome, failure

log = logging.getLogger("sandbox.pool")

QuarantineKey = tuple[str, str, int]


class Quarantine:
    """Crash counts and quarantined script versions, per guild."""

    crash_limit: int
    crash_window_s: float
    quarantine_s: float
    _crashes: dict[QuarantineKey, deque[float]]
    _quarantine: dict[QuarantineKey, tuple[float, str, int]]
    _c: dict[str, int]

    def _quarantined(self, req: RequestState, now: float) -> Outcome | None:
        """The answer for a request whose script version is quarantined, else None."""
        ref = req.ref
        q = self._quarantine.get((req.guild, ref.key, ref.version))
        if q is None:
            return None
        until, reason, n = q
        if now >= until:
            del self._quarantine[(req.guild, ref.key, ref.version)]
            return None
        self._c["quarantined"] += 1
        return failure("crash", f"script quarantined for {until - now:.0f} s more: it crashed "
                       f"its worker {n} times within {self.crash_window_s:.0f} s (last: {reason})",
                       0.0)

    def _note_crash(self, req: RequestState, reason: str, now: float) -> None:
        """Count a crash against the request's (guild, script version)."""
        if req.kind != "job" or self.crash_limit <= 0:
            return
        key = (req.guild, req.ref.key, req.ref.version)
        times = self._crashes.get(key)
        if times is None:
            times = self._crashes[key] = deque()
        times.append(now)
        while now - times[0] > self.crash_window_s:
            times.popleft()
        if len(times) >= self.crash_limit:
            del self._crashes[key]
            self._quarantine[key] = (now + self.quarantine_s, reason, len(times))
            log.warning("sandbox: script %s version %d of guild %s crashed its worker %d times "
                        "within %.0f s (%s); quarantined for %.0f s", key[1], key[2],
                        key[0] or "-", len(times), self.crash_window_s, reason, self.quarantine_s)

    def _sweep_quarantine(self, now: float) -> None:
        """Housekeeping: forget crash counts past their window and ended quarantines."""
        stale = [k for k, times in self._crashes.items()
                 if not times or now - times[-1] > self.crash_window_s]
        for k in stale:
            del self._crashes[k]
        for k in [k for k, q in self._quarantine.items() if q[0] <= now]:
            del self._quarantine[k]
