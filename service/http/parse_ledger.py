"""What decoding bodies costs the event loop and memory, per guild: the ledger of
refunded requests' decoding, and the count of large bodies held (`HeldBodies`).

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


#: Bodies at least this long count as held (see `HeldBodies`).
HELD_BYTES = 16 * 1024
#: Requests with such bodies a guild may have decoded and not yet answered.
MAX_HELD_PER_GUILD = 16


class HeldBodies:
    """Per guild: requests with a large body decoded and not yet finished.

    A decoded body is kept while its request waits and runs: up to ~4 MB of
    objects (50,000 values) and its raw MiB. The pool's queue holds 256
    requests a worker, so one guild could keep gigabytes in a full queue
    (review, session 28); past `MAX_HELD_PER_GUILD` a guild's next large body
    is refused 503 `busy` before it is decoded."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}

    def take(self, guild: str) -> bool:
        """Hold one more for `guild`, unless it holds as many as it may."""
        held = self._held.get(guild, 0)
        if held >= MAX_HELD_PER_GUILD:
            return False
        self._held[guild] = held + 1
        return True

    def release(self, guild: str) -> None:
        held = self._held.get(guild, 0) - 1
        if held > 0:
            self._held[guild] = held
        else:
            self._held.pop(guild, None)

    def held(self, guild: str) -> int:
        return self._held.get(guild, 0)
