"""The bounds of the queue of compiles for the code cache (`sandbox.compiling`).

A version a worker compiled for its own job reaches the cache later, compiled
again by the compile worker; nobody waits for those compiles, so they queue:
at most `BACKGROUND_COMPILES` sources and `BACKGROUND_CHARS` characters in
all, one guild's at most a `BACKGROUND_SHARE`-th of each (red-team pass,
session 34: one guild's flood of long versions kept every other guild's out).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

BACKGROUND_COMPILES = 256
BACKGROUND_CHARS = 16 << 20
#: One guild's share of that queue: the others' long versions still get in.
BACKGROUND_SHARE = 8


def has_room(queue: Iterable[tuple[Any, str, Any]], guild: str, source: str) -> bool:
    """Whether `guild`'s `source` may join `queue` (items: (key, source, future),
    the key's first element the guild) within the bounds above."""
    count = chars = mine = own_chars = 0
    for key, queued, _ in queue:
        count += 1
        chars += len(queued)
        if key[0] == guild:
            mine += 1
            own_chars += len(queued)
    return (count < BACKGROUND_COMPILES
            and chars + len(source) <= BACKGROUND_CHARS
            and mine < BACKGROUND_COMPILES // BACKGROUND_SHARE
            and own_chars + len(source) <= BACKGROUND_CHARS // BACKGROUND_SHARE)
