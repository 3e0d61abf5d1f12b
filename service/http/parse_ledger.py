"""What decoding the bodies of refunded requests has cost the event loop, per guild.

An invoke body is decoded on the event loop before its request is queued
(`service.http.script_run`), and a request answered 503 `busy` gives its
quota slot back, so that a retry after a 503 is counted once. Together they
let a guild have bodies decoded past its rate limit: requests that wait in a
full queue and time out, again and again, each decoded first (second review,
session 28: 120 bodies of 49,000 values decoded in 12 s, 96 of them given
back). The ledger keeps, per guild, the seconds that the bodies of its
refunded requests took to decode, leaking at `RATE_S` a second; a refund
that would take the total past `BURST_S` is not made (the 503 keeps its
quota slot), so its decoding is bounded by its plan's rate limit like any
other work. Requests that ran were paid for by their quota and are not
charged; a guild refused busy now and then keeps its refunds.
"""
from __future__ import annotations

import time
from collections.abc import Callable

#: Seconds of decoding a second a guild may have given back (5 % of the loop).
RATE_S = 0.05
#: Seconds of decoding a guild may have given back ahead of `RATE_S`.
BURST_S = 0.5
#: Guilds remembered at most (the oldest entries go first; all of them leak to 0).
MAX_GUILDS = 4096


class ParseLedger:
    """Per guild: seconds of decoding given back, leaking at `RATE_S`."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock or time.monotonic
        self._spent: dict[str, tuple[float, float]] = {}   # guild -> (seconds, as of)

    def _now_spent(self, guild: str, now: float) -> float:
        entry = self._spent.get(guild)
        if entry is None:
            return 0.0
        spent, at = entry
        return max(0.0, spent - (now - at) * RATE_S)

    def refund(self, guild: str, seconds: float) -> bool:
        """Whether a 503 of `guild` whose body took `seconds` to decode gives its
        quota slot back; when it does, the seconds are charged."""
        now = self._clock()
        spent = self._now_spent(guild, now) + seconds
        if spent > BURST_S:
            return False
        spent_map = self._spent
        spent_map.pop(guild, None)
        spent_map[guild] = (spent, now)
        if len(spent_map) > MAX_GUILDS:
            del spent_map[next(iter(spent_map))]
        return True
