"""The sliding windows behind 429 `rate_limited` and `auth_throttled`.

The in-memory windows run on an injected clock so a minute passes instantly;
the shared (Redis) storage runs against the real server at 127.0.0.1:6379.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest

from service.http.ratelimit import AUTH_FAILURES_PER_MINUTE, RateLimits


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_quota_is_exact_and_slots_free_as_the_window_slides() -> None:
    clock = Clock()
    limits = RateLimits(clock=clock)
    decisions = []
    for _ in range(30):
        decisions.append(limits.hit_endpoint(1, 30))
        clock.now += 1.0
    assert all(d.allowed for d in decisions)
    assert [d.remaining for d in decisions] == list(range(29, -1, -1))
    refused = limits.hit_endpoint(1, 30)  # t = 30 s: the first hit leaves the window at 60 s
    assert not refused.allowed and refused.remaining == 0 and refused.reset_seconds == 30
    assert refused.headers() == {"RateLimit-Limit": "30", "RateLimit-Remaining": "0",
                                 "RateLimit-Reset": "30"}
    clock.now += 30.0  # t = 60 s: exactly one slot (the t = 0 hit) is free
    assert limits.hit_endpoint(1, 30).allowed
    assert not limits.hit_endpoint(1, 30).allowed
    # Refused hits are not counted: after another second one more slot is free.
    clock.now += 1.0
    assert limits.hit_endpoint(1, 30).allowed


def test_endpoints_have_separate_windows_and_peek_counts_nothing() -> None:
    clock = Clock()
    limits = RateLimits(clock=clock)
    for _ in range(3):
        limits.hit_endpoint(1, 3)
    assert not limits.hit_endpoint(1, 3).allowed
    assert limits.hit_endpoint(2, 3).allowed
    peek = limits.peek_endpoint(2, 3)
    assert peek.remaining == 2 and peek.reset_seconds == 60
    assert limits.peek_endpoint(2, 3).remaining == 2
    assert limits.peek_endpoint(3, 3).reset_seconds == 0


def test_refusal_never_says_retry_after_zero() -> None:
    clock = Clock()
    limits = RateLimits(clock=clock)
    limits.hit_endpoint(1, 1)
    clock.now += 59.9
    refused = limits.hit_endpoint(1, 1)
    assert not refused.allowed and refused.reset_seconds == 1


def test_auth_throttle_after_twenty_failures_for_sixty_seconds() -> None:
    clock = Clock()
    limits = RateLimits(clock=clock)
    for _ in range(AUTH_FAILURES_PER_MINUTE):
        assert limits.auth_throttled("198.51.100.7") == 0
        limits.auth_failed("198.51.100.7")
    assert limits.auth_throttled("198.51.100.7") == 60
    assert limits.auth_throttled("198.51.100.8") == 0
    clock.now += 59.5
    assert limits.auth_throttled("198.51.100.7") == 1
    clock.now += 0.5
    assert limits.auth_throttled("198.51.100.7") == 0


def test_idle_keys_are_forgotten() -> None:
    clock = Clock()
    limits = RateLimits(clock=clock)
    for n in range(5000):
        limits.auth_failed(f"10.0.{n // 250}.{n % 250}")
    clock.now += 61
    for _ in range(10_000):
        limits.hit_endpoint(1, 10**9)
    windows = limits._windows
    assert len(windows._hits) == 1  # type: ignore[union-attr]


def _refund_scenario(limits: RateLimits, clock) -> None:
    """Three hits of a limit of 3 at 0, 10 and 20 s; the first answered busy at
    25 s gives its slot back, a fourth takes it at 30 s. Until the second hit
    leaves the window (70 s) three requests that ran are in it: a fifth is
    refused at 61 s, admitted after 70 s."""
    first = limits.hit_endpoint(1, 3)
    for _ in range(2):
        clock.now += 10.0
        assert limits.hit_endpoint(1, 3).allowed
    clock.now += 5.0
    limits.refund_endpoint(1, 3, first.stamp)
    clock.now += 5.0
    assert limits.hit_endpoint(1, 3).allowed
    clock.now += 31.0        # 61 s
    assert not limits.hit_endpoint(1, 3).allowed
    clock.now += 9.5         # 70.5 s
    assert limits.hit_endpoint(1, 3).allowed


def test_a_refund_gives_back_the_requests_own_slot_not_the_newest() -> None:
    """Outside review, session 21: a refund took back the newest hit, so the
    refunded request's older hit stayed and a later one left early: 43
    scripts ran in 58 s on a 30/min plan."""
    class Clock:
        now = 1_000_000.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    _refund_scenario(RateLimits(clock=clock), clock)


def _redis_url() -> str:
    url = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    try:
        import redis
    except ImportError:
        pytest.skip("the redis client is not installed")
    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except redis.exceptions.ConnectionError as exc:
        pytest.skip(f"Redis at {url} is not reachable: {exc}")
    return url


def test_shared_storage_on_the_real_redis_is_exact() -> None:
    url = _redis_url()

    async def scenario() -> None:
        a, b = RateLimits(url), RateLimits(url)  # two nodes sharing their counts
        assert a.remote and b.remote
        endpoint = int(uuid.uuid4().int % 10**12)
        results = [await (a if n % 2 else b).ahit_endpoint(endpoint, 5) for n in range(6)]
        assert [r.allowed for r in results] == [True] * 5 + [False]
        assert [r.remaining for r in results[:5]] == [4, 3, 2, 1, 0]
        assert 59 <= results[5].reset_seconds <= 60
        assert (await a.apeek_endpoint(endpoint, 5)).remaining == 0
        # A request answered busy gives its own slot back, not the newest one.
        await b.arefund_endpoint(endpoint, 5, results[0].stamp)
        assert (await a.apeek_endpoint(endpoint, 5)).remaining == 1
        import redis
        stored = redis.Redis.from_url(url).lrange(f"LIMITS:LIMITER/logic/ep:{endpoint}/5/1/minute",
                                                  0, -1)
        assert [e.decode() for e in stored] == [r.stamp for r in reversed(results[1:5])]
        ip = f"203.0.113.{endpoint % 250}-{endpoint}"
        for _ in range(AUTH_FAILURES_PER_MINUTE):
            assert await a.aauth_throttled(ip) == 0
            await b.aauth_failed(ip)
        assert 59 <= await a.aauth_throttled(ip) <= 60
        assert a.storage_state() == {"state": "up", "storage": "redis", "onError": "open"}
        await a.close()
        await b.close()

    asyncio.run(scenario())


def test_installations_windows_in_one_redis_are_apart_and_nodes_of_one_share_them() -> None:
    url = _redis_url()
    ours, theirs = uuid.uuid4().hex[:16], uuid.uuid4().hex[:16]

    async def scenario() -> None:
        a1, a2 = RateLimits(url, installation=ours), RateLimits(url, installation=ours)
        b = RateLimits(url, installation=theirs)
        for n in range(3):
            assert (await (a1 if n % 2 else a2).ahit_endpoint(1, 3)).allowed
        assert not (await a1.ahit_endpoint(1, 3)).allowed   # one installation: shared
        assert (await b.ahit_endpoint(1, 3)).allowed          # another: its own window
        for limits in (a1, a2, b):
            await limits.close()

    asyncio.run(scenario())


def test_memory_storage_answers_the_async_calls_too() -> None:
    async def scenario() -> None:
        clock = Clock()
        limits = RateLimits(clock=clock)
        assert not limits.remote
        assert [(await limits.ahit_endpoint(1, 2)).allowed for _ in range(3)] == [True, True, False]
        assert limits.hit_endpoint(1, 2).allowed is False  # one window behind both interfaces
        assert limits.storage_state() == {"state": "up", "storage": "memory"}

    asyncio.run(scenario())


def test_on_storage_error_is_validated() -> None:
    with pytest.raises(ValueError, match="on_storage_error"):
        RateLimits(on_storage_error="maybe")


def test_checks_running_count_towards_the_allowance_and_right_ones_let_waiters_in() -> None:
    """`auth_admit` gives at most 20 turns at once to one address; the 21st waits
    while checks run and gets in when one ends right; once 20 failures are counted,
    a request with no check left to wait for is refused."""
    async def run() -> None:
        limits = RateLimits()
        ip = "203.0.113.5"
        assert [await limits.auth_admit(ip) for _ in range(20)] == [0] * 20
        waiting = asyncio.ensure_future(limits.auth_admit(ip))
        await asyncio.sleep(0.01)
        assert not waiting.done()                      # 20 checks running: it waits
        await limits.auth_settle(ip, failed=False)     # one proved right
        assert await asyncio.wait_for(waiting, 1) == 0
        for _ in range(20):
            await limits.auth_settle(ip, failed=True)  # every other one was wrong
        assert await limits.auth_admit(ip) > 0          # 20 failures, nothing running
        assert await limits.auth_admit("203.0.113.6") == 0   # another address

    asyncio.run(run())


def test_a_check_ending_while_the_shared_count_is_read_is_not_missed() -> None:
    """With the windows in Redis a look at the count is a round trip: a check that
    ends (counting its failure) while the look is on its way may be missing from the
    answer, and from `checking` too. The look is then repeated, so the 20th failure
    is not followed by a 21st check."""
    async def run() -> None:
        limits = RateLimits()
        ip = "203.0.113.7"
        for _ in range(19):
            limits.auth_failed(ip)
        assert await limits.auth_admit(ip) == 0               # check A: 19 failures + 1
        real_peek = limits._apeek
        release = asyncio.Event()
        stale: list[int] = []

        async def slow_peek(key: str, limit: int) -> tuple[int, float]:
            if not stale:                                      # the first look: answered
                count, oldest = await real_peek(key, limit)    # as Redis saw it, late
                stale.append(count)
                await release.wait()
                return count, oldest
            return await real_peek(key, limit)

        limits._apeek = slow_peek                              # type: ignore[method-assign]
        looking = asyncio.ensure_future(limits.auth_admit(ip))  # B looks: 19
        await asyncio.sleep(0.01)
        await limits.auth_settle(ip, failed=True)              # A was wrong: 20 failures
        release.set()
        assert stale == [19]
        assert await asyncio.wait_for(looking, 1) > 0          # B looked again: refused
        assert limits._gates == {}

    asyncio.run(run())


def test_waiting_requests_of_one_address_are_bounded() -> None:
    """At most 20 requests of an address wait for its running checks; more are
    refused at once (a flood holds nothing)."""
    from service.http.ratelimit import AUTH_WAITERS_PER_ADDRESS

    async def run() -> None:
        limits = RateLimits()
        ip = "203.0.113.8"
        assert [await limits.auth_admit(ip) for _ in range(20)] == [0] * 20
        waiting = [asyncio.ensure_future(limits.auth_admit(ip))
                   for _ in range(AUTH_WAITERS_PER_ADDRESS)]
        await asyncio.sleep(0.01)
        assert not any(w.done() for w in waiting)
        assert await limits.auth_admit(ip) == 1                # one too many: refused now
        for _ in range(20):
            await limits.auth_settle(ip, failed=True)
        assert all(r > 0 for r in await asyncio.gather(*waiting))
        assert limits._gates == {}

    asyncio.run(run())


def test_a_right_credential_lets_the_longest_waiting_request_in() -> None:
    """A check that proves right frees its turn for one waiting request, the one that
    waited longest; a wrong one frees nothing (its turn became a failure) until no
    check is left, when every waiting request looks again."""
    async def run() -> None:
        limits = RateLimits()
        ip = "203.0.113.9"
        assert [await limits.auth_admit(ip) for _ in range(20)] == [0] * 20
        first = asyncio.ensure_future(limits.auth_admit(ip))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(limits.auth_admit(ip))
        await asyncio.sleep(0.01)
        await limits.auth_settle(ip, failed=True)        # wrong: nobody goes on
        await asyncio.sleep(0.01)
        assert not first.done() and not second.done()
        await limits.auth_settle(ip, failed=False)       # right: the first waiter goes
        assert await asyncio.wait_for(first, 1) == 0
        await asyncio.sleep(0.01)
        assert not second.done()
        for _ in range(19):                              # the 18 left and the first: wrong
            await limits.auth_settle(ip, failed=True)
        assert await asyncio.wait_for(second, 1) > 0     # 20 failures, none running: refused
        assert limits._gates == {}

    asyncio.run(run())
