"""Latency sketch: durations as logarithmic keys, percentiles within 1 % of the truth.

DDSketch's mapping (Masson et al., VLDB 2019): with `GAMMA = (1 + a) / (1 - a)`
a duration `x` gets the key `ceil(log(x) / log(GAMMA))`, and every duration
with that key lies in `(GAMMA**(k-1), GAMMA**k]`.  Reporting the key as
`2 * GAMMA**k / (GAMMA + 1)` is then within the relative error `a` of every
duration in it.  The p-th percentile is the value of the key that holds the
request of nearest rank `ceil(p * n)` (1-based, in duration order: the
smallest duration with at least a fraction p of all at or below it), so it is
within 1 % of that request's real duration.  Counts add up, so per-minute sketches
merge into the 24 h window exactly.

Durations under `MIN_MS` share the lowest key (the error bound holds from
`MIN_MS` up); the key range fits a small integer column.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping

RELATIVE_ERROR = 0.01
GAMMA = (1 + RELATIVE_ERROR) / (1 - RELATIVE_ERROR)
_LOG_GAMMA = math.log(GAMMA)
MIN_MS = 0.001          # 1 µs
MAX_MS = 3_600_000.0    # 1 h: longer is reported as 1 h
_MIN_KEY = math.ceil(math.log(MIN_MS) / _LOG_GAMMA)
_MAX_KEY = math.ceil(math.log(MAX_MS) / _LOG_GAMMA)


def key_of(duration_ms: float) -> int:
    """The sketch key of a duration (ms)."""
    if not duration_ms > MIN_MS:        # also NaN
        return _MIN_KEY
    if duration_ms >= MAX_MS:
        return _MAX_KEY
    return math.ceil(math.log(duration_ms) / _LOG_GAMMA)


def value_of(key: int) -> float:
    """The duration (ms) reported for a key: within `RELATIVE_ERROR` of all it holds."""
    return 2.0 * GAMMA ** key / (GAMMA + 1.0)


def quantiles(counts: Mapping[int, int] | Iterable[tuple[int, int]],
              ps: Iterable[float]) -> list[float | None]:
    """The durations (ms) at each quantile `p` in [0, 1]; None without data."""
    pairs = sorted((counts.items() if isinstance(counts, Mapping) else counts))
    total = sum(n for _, n in pairs)
    out: list[float | None] = []
    for p in ps:
        if total == 0:
            out.append(None)
            continue
        # Nearest rank: the smallest duration with at least p of all at or below it.
        rank = max(1, math.ceil(p * total - 1e-9))
        seen = 0
        for key, n in pairs:
            seen += n
            if seen >= rank:
                out.append(round(value_of(key), 3))
                break
        else:  # pragma: no cover - rank < total always stops the loop
            out.append(round(value_of(pairs[-1][0]), 3))
    return out
