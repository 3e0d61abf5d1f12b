"""Sliding-window limits: requests per endpoint and failed secrets per IP.

Both are exact moving windows of 60 s: "how many in the last 60 s" and "when
does a slot free" have exact answers. `[ratelimit] storage` picks where the
windows live:

- ``memory://`` (one node): a deque of timestamps per key, owned by the event
  loop thread. Amortised O(1) per request, no locks, no threads.
- anything else, e.g. ``redis://host:6379/0`` (several nodes sharing limits):
  the `limits` library's moving-window strategy on that storage.

Why not `limits`' own memory storage as well: measured on the invoke path it
cost about a fifth of the service's CPU per request (two locked calls per
request, an O(n) list insert, and a timer thread started every 10 ms to expire
entries), for what a deque does in a few lines.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: DESIGN section 4: more than this many wrong secrets from one IP in 60 s are throttled.
AUTH_FAILURES_PER_MINUTE = 20
WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class Decision:
    """The state of an endpoint's window after (or without) counting a request."""

    allowed: bool
    limit: int
    remaining: int
    reset_seconds: int  # whole seconds until the oldest counted request leaves the window

    def headers(self) -> dict[str, str]:
        return {
            "RateLimit-Limit": str(self.limit),
            "RateLimit-Remaining": str(self.remaining),
            "RateLimit-Reset": str(self.reset_seconds),
        }


class _Windows:
    """Moving windows: one deque of hit times per key (memory:// storage)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._hits: dict[str, deque[float]] = {}
        self._ops = 0

    def _window(self, key: str, now: float) -> deque[float] | None:
        q = self._hits.get(key)
        if q is not None:
            edge = now - WINDOW_S
            while q and q[0] <= edge:
                q.popleft()
        return q

    def hit(self, key: str, limit: int) -> tuple[bool, int, float]:
        """Count a hit if a slot is free: (allowed, hits in window, oldest hit time)."""
        now = self._clock()
        self._ops += 1
        if self._ops % 10_000 == 0:
            self._sweep(now)
        q = self._window(key, now)
        if q is None:
            q = self._hits[key] = deque()
        allowed = len(q) < limit
        if allowed:
            q.append(now)
        return allowed, len(q), q[0] if q else now

    def peek(self, key: str, limit: int) -> tuple[int, float]:
        now = self._clock()
        q = self._window(key, now)
        return (len(q), q[0]) if q else (0, now)

    def refund(self, key: str, limit: int) -> None:
        """Take back the newest hit of ``key``."""
        q = self._hits.get(key)
        if q:
            q.pop()

    def _sweep(self, now: float) -> None:
        """Forget keys with no hit in the window, so memory follows active keys only."""
        for key in [k for k, q in self._hits.items() if not q or q[-1] <= now - WINDOW_S]:
            del self._hits[key]


class _LibraryWindows:
    """The same interface over the `limits` library (shared storages such as Redis)."""

    def __init__(self, storage_uri: str) -> None:
        from limits import RateLimitItemPerMinute
        from limits.storage import storage_from_string
        from limits.strategies import MovingWindowRateLimiter

        self._item_type = RateLimitItemPerMinute
        self._limiter = MovingWindowRateLimiter(storage_from_string(storage_uri))
        self._items: dict[int, RateLimitItemPerMinute] = {}

    def _item(self, limit: int) -> object:
        item = self._items.get(limit)
        if item is None:
            item = self._items[limit] = self._item_type(limit, namespace="logic")
        return item

    def hit(self, key: str, limit: int) -> tuple[bool, int, float]:
        item = self._item(limit)
        allowed = self._limiter.hit(item, key)  # type: ignore[arg-type]
        reset_at, remaining = self._limiter.get_window_stats(item, key)  # type: ignore[arg-type]
        return allowed, limit - remaining, reset_at - WINDOW_S

    def peek(self, key: str, limit: int) -> tuple[int, float]:
        item = self._item(limit)  # the library's keys include the limit
        reset_at, remaining = self._limiter.get_window_stats(item, key)  # type: ignore[arg-type]
        return limit - remaining, reset_at - WINDOW_S

    def refund(self, key: str, limit: int) -> None:
        """Take back the newest hit of ``key`` (Redis: the moving window is a list, newest
        first; other storages of the library keep the hit)."""
        storage: Any = self._limiter.storage
        if hasattr(storage, "prefixed_key") and hasattr(storage, "get_connection"):
            full = self._item(limit).key_for(key)  # type: ignore[attr-defined]
            storage.get_connection().lpop(storage.prefixed_key(full))


class RateLimits:
    """Per-endpoint request quotas and per-IP failed-secret throttling."""

    def __init__(self, storage_uri: str = "memory://",
                 clock: Callable[[], float] = time.time, ipv6_prefix: int = 64,
                 windows: _Windows | None = None) -> None:
        """`windows`: memory:// windows to use instead of this process's own (the
        front processes' shared ones, `service.http.shared_windows`)."""
        self._clock = clock
        self._ipv6_prefix = ipv6_prefix
        self._windows: _Windows | _LibraryWindows = (
            _LibraryWindows(storage_uri) if not storage_uri.startswith("memory://")
            else windows if windows is not None else _Windows(clock))

    def _reset(self, count: int, oldest: float) -> int:
        if count == 0:
            return 0
        return max(0, math.ceil(oldest + WINDOW_S - self._clock()))

    def hit_endpoint(self, endpoint_id: int, per_minute: int) -> Decision:
        """Count one authenticated request against the endpoint's quota, if a slot is free."""
        allowed, count, oldest = self._windows.hit(f"ep:{endpoint_id}", per_minute)
        reset = self._reset(count, oldest)
        if not allowed:
            reset = max(1, reset)  # a slot frees within this second: never say 0
        return Decision(allowed, per_minute, max(0, per_minute - count), reset)

    def refund_endpoint(self, endpoint_id: int, per_minute: int) -> None:
        """Give back the slot the endpoint's newest request took (it was answered 503 busy)."""
        self._windows.refund(f"ep:{endpoint_id}", per_minute)

    def peek_endpoint(self, endpoint_id: int, per_minute: int) -> Decision:
        """The endpoint's window without counting a request."""
        count, oldest = self._windows.peek(f"ep:{endpoint_id}", per_minute)
        return Decision(True, per_minute, max(0, per_minute - count), self._reset(count, oldest))

    def hit_key(self, key: str, per_minute: int) -> Decision:
        """Count one request under any other key (e.g. the admin API's per-token
        limit, ``api:<token id>``), if a slot is free."""
        allowed, count, oldest = self._windows.hit(key, per_minute)
        reset = self._reset(count, oldest)
        if not allowed:
            reset = max(1, reset)
        return Decision(allowed, per_minute, max(0, per_minute - count), reset)
    def auth_key(self, ip: str) -> str:
        """Whose failures `ip`'s count with: an IPv4 address itself, an IPv6
        address its network of `ipv6_prefix` bits (one subscriber's /64 holds
        more addresses than anyone could rotate through)."""
        if ":" not in ip:
            return ip
        try:
            address = ipaddress.IPv6Address(ip)
        except ValueError:
            return ip
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, self._ipv6_prefix), strict=False))

    def auth_throttled(self, ip: str) -> int:
        """Seconds the IP must wait before its secrets are checked again; 0 if not throttled."""
        count, oldest = self._windows.peek(f"auth:{self.auth_key(ip)}", AUTH_FAILURES_PER_MINUTE)
        if count < AUTH_FAILURES_PER_MINUTE:
            return 0
        return max(1, self._reset(count, oldest))

    def auth_failed(self, ip: str) -> None:
        """Record one wrong secret presented from `ip`."""
        self._windows.hit(f"auth:{self.auth_key(ip)}", AUTH_FAILURES_PER_MINUTE)
