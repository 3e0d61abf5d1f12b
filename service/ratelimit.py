"""Sliding-window limits: requests per endpoint and failed secrets per IP.

Both are exact moving windows of 60 s kept by the `limits` library, so the
answer to "how many in the last 60 s" and "when does a slot free" is exact. The
storage is chosen by `[ratelimit] storage` (``memory://`` for one node, a Redis
URL when several nodes must share their counts).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from limits import RateLimitItemPerMinute
from limits.storage import storage_from_string
from limits.strategies import MovingWindowRateLimiter

#: DESIGN section 4: more than this many wrong secrets from one IP in 60 s are throttled.
AUTH_FAILURES_PER_MINUTE = 20


@dataclass(frozen=True, slots=True)
class Decision:
    """The state of an endpoint's window after (or without) counting a request."""

    allowed: bool
    limit: int
    remaining: int
    reset_seconds: int  # whole seconds until the oldest request leaves the window

    def headers(self) -> dict[str, str]:
        return {
            "RateLimit-Limit": str(self.limit),
            "RateLimit-Remaining": str(self.remaining),
            "RateLimit-Reset": str(self.reset_seconds),
        }


class RateLimits:
    """Per-endpoint request quotas and per-IP failed-secret throttling."""

    def __init__(self, storage_uri: str = "memory://") -> None:
        self._storage = storage_from_string(storage_uri)
        self._limiter = MovingWindowRateLimiter(self._storage)
        self._items: dict[int, RateLimitItemPerMinute] = {}
        self._auth_item = RateLimitItemPerMinute(AUTH_FAILURES_PER_MINUTE, namespace="auth")

    def _item(self, per_minute: int) -> RateLimitItemPerMinute:
        item = self._items.get(per_minute)
        if item is None:
            item = self._items[per_minute] = RateLimitItemPerMinute(per_minute, namespace="ep")
        return item

    def _decision(self, allowed: bool, item: RateLimitItemPerMinute, key: str) -> Decision:
        reset_at, remaining = self._limiter.get_window_stats(item, key)
        reset = max(0, math.ceil(reset_at - time.time())) if remaining < item.amount else 0
        return Decision(allowed, item.amount, max(0, remaining), reset)

    def hit_endpoint(self, endpoint_id: int, per_minute: int) -> Decision:
        """Count one authenticated request against the endpoint's quota, if a slot is free."""
        item = self._item(per_minute)
        key = str(endpoint_id)
        allowed = self._limiter.hit(item, key)
        decision = self._decision(allowed, item, key)
        if not allowed and decision.reset_seconds == 0:
            # A slot frees within the current second: never tell a client 0.
            decision = Decision(False, decision.limit, 0, 1)
        return decision

    def peek_endpoint(self, endpoint_id: int, per_minute: int) -> Decision:
        """The endpoint's window without counting a request."""
        item = self._item(per_minute)
        return self._decision(True, item, str(endpoint_id))

    def auth_throttled(self, ip: str) -> int:
        """Seconds the IP must wait before its secrets are checked again; 0 if not throttled."""
        if self._limiter.test(self._auth_item, ip):
            return 0
        reset_at, _ = self._limiter.get_window_stats(self._auth_item, ip)
        return max(1, math.ceil(reset_at - time.time()))

    def auth_failed(self, ip: str) -> None:
        """Record one wrong secret presented from `ip`."""
        self._limiter.hit(self._auth_item, ip)
