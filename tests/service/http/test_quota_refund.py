"""A request answered 503 busy gives its quota slot back (memory:// and Redis)."""
from __future__ import annotations

import uuid

import pytest

from service.http.ratelimit import RateLimits
from tests.service.http.test_ratelimit import _redis_url


@pytest.mark.parametrize("storage", ["memory", "redis"])
def test_refund_gives_the_requests_own_slot_back(storage: str) -> None:
    limits = RateLimits("memory://" if storage == "memory" else _redis_url())
    endpoint = uuid.uuid4().int % 10**9   # a fresh key on a shared Redis
    for _ in range(3):
        decision = limits.hit_endpoint(endpoint, 3)
    assert decision.remaining == 0
    assert not limits.hit_endpoint(endpoint, 3).allowed
    limits.refund_endpoint(endpoint, 3, decision.stamp)   # its own (here also the newest)
    assert limits.peek_endpoint(endpoint, 3).remaining == 1
    assert limits.hit_endpoint(endpoint, 3).allowed
