"""What decoding large bodies has cost the event loop, per guild.

An invoke body is decoded on the event loop before its request is queued
(`service.http.script_run`), and a request answered 503 `busy` gives its
quota slot back, so that a retry after a 503 is counted once. Together they
let a guild have bodies decoded past its rate limit: requests that wait in a
full queue and time out, again and again, each decoded first (second review,
session 28: 120 bodies of 49,000 values decoded in 12 s, 96 of them given
back). The ledger keeps, per guild, the seconds its large bodies took to
decode, leaking at `RATE_S` a second; while a guild's total is over
`BURST_S`, its 503s keep their quota slots, so its decoding is bounded by its
plan's rate limit like any other work. A guild whose bodies are small, or
that is rarely refused busy, keeps the refund.
"""
from __future__ import annotations

import time
from collections.abc import Callable

#: Bodies at least this long are timed (shorter ones decode in well under a ms).
TIMED_BYTES = 16384
#: Seconds of decoding a second a guild may have given back (5 % of the loop).
RATE_S = 0.05
#: Seconds of decoding a guild may run ahead of `RATE_S` before refunds stop.
BURST_S = 0.5
#: Guilds remembered at most (the oldest entries go first; all of them leak to 0).
MAX_GUILDS = 4096


class ParseLedger:
    """Per guild: seconds of decoding, leaking at `RATE_S`."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock or time.monotonic
        self._spent: dict[str, tuple[float, float]] = {}   # guild -> (seconds, as of)

    def _now_spent(self, guild: str, now: float) -> float:
        entry = self._spent.get(guild)
        if entry is None:
            return 0.0
        spent, at = entry
        return max(0.0, spent - (now - at) * RATE_S)

    def charge(self, guild: str, seconds: float) -> None:
        """`guild`'s body took `seconds` to decode."""
        now = self._clock()
        spent = self._now_spent(guild, now) + seconds
        spent_map = self._spent
        spent_map.pop(guild, None)
        spent_map[guild] = (spent, now)
        if len(spent_map) > MAX_GUILDS:
            del spent_map[next(iter(spent_map))]

    def refunds(self, guild: str) -> bool:
        """Whether `guild`'s 503s still give their quota slots back."""
        return self._now_spent(guild, self._clock()) <= BURST_S
