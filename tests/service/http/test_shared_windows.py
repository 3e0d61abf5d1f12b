"""The rate-limit windows the front processes share (`service.http.shared_windows`).

The same exact moving windows as one process's deques, across real forked
processes; a clock is injected so a minute passes instantly.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from service.http.ratelimit import AUTH_FAILURES_PER_MINUTE, RateLimits
from service.http.shared_windows import PROBE, SharedWindows


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _limits(tmp_path: Path, clock: Clock, **kwargs: int) -> tuple[RateLimits, SharedWindows]:
    windows = SharedWindows(clock=clock, **kwargs)
    return RateLimits(clock=clock, windows=windows), windows


def test_the_window_is_exact_and_slides_as_in_one_process(tmp_path: Path) -> None:
    clock = Clock()
    limits, _ = _limits(tmp_path, clock)
    decisions = []
    for _ in range(30):
        decisions.append(limits.hit_endpoint(1, 30))
        clock.now += 1.0
    assert all(d.allowed for d in decisions)
    assert [d.remaining for d in decisions] == list(range(29, -1, -1))
    refused = limits.hit_endpoint(1, 30)  # t = 30 s: the first hit leaves the window at 60 s
    assert not refused.allowed and refused.remaining == 0 and refused.reset_seconds == 30
    clock.now += 30.0  # t = 60 s: exactly one slot is free
    assert limits.hit_endpoint(1, 30).allowed
    assert not limits.hit_endpoint(1, 30).allowed
    other = limits.hit_endpoint(2, 30)  # another endpoint, another window
    assert other.allowed and limits.peek_endpoint(2, 30).remaining == 29
    limits.refund_endpoint(2, 30, other.stamp)
    assert limits.peek_endpoint(2, 30).remaining == 30


def _admitted_by_forks(windows: SharedWindows, clock: Clock | None = None) -> int:
    """Four forked processes (as fronts), each trying 50 requests against one
    30/min endpoint: how many were admitted in all."""
    children = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                limits = (RateLimits(windows=windows) if clock is None
                          else RateLimits(clock=clock, windows=windows))
                code = sum(limits.hit_endpoint(7, 30).allowed for _ in range(50))
            finally:
                os._exit(code)
        children.append(pid)
    admitted = 0
    for pid in children:
        _, status = os.waitpid(pid, 0)
        admitted += os.WEXITSTATUS(status)
    return admitted


def test_forked_processes_share_one_exact_window(tmp_path: Path) -> None:
    windows = SharedWindows()
    admitted = _admitted_by_forks(windows)
    assert admitted == 30
    assert RateLimits(windows=windows).peek_endpoint(7, 30).remaining == 0


def test_the_auth_throttle_counts_failures_from_every_process(tmp_path: Path) -> None:
    clock = Clock()
    windows = SharedWindows(clock=clock)
    pid = os.fork()
    if pid == 0:
        try:
            limits = RateLimits(clock=clock, windows=windows)
            for _ in range(AUTH_FAILURES_PER_MINUTE // 2):
                limits.auth_failed("198.51.100.7")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    limits = RateLimits(clock=clock, windows=windows)
    for _ in range(AUTH_FAILURES_PER_MINUTE // 2):
        assert limits.auth_throttled("198.51.100.7") == 0
        limits.auth_failed("198.51.100.7")
    assert limits.auth_throttled("198.51.100.7") == 60
    assert limits.auth_throttled("198.51.100.8") == 0


def test_a_process_killed_holding_the_lock_does_not_stop_the_others(tmp_path: Path) -> None:
    windows = SharedWindows()
    pid = os.fork()
    if pid == 0:
        windows._mutex.acquire()  # as if killed mid-update
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    limits = RateLimits(windows=windows)
    assert limits.hit_endpoint(1, 5).allowed  # would block forever
    assert limits.hit_endpoint(1, 5).remaining == 3  # and the lock works on


def test_limits_above_the_ring_never_admit_more_than_the_limit(tmp_path: Path) -> None:
    clock = Clock()
    limits, _ = _limits(tmp_path, clock, ring=8)
    admitted = 0
    for _ in range(400):  # 400 hits over 40 s against 100/min
        admitted += limits.hit_endpoint(1, 100).allowed
        clock.now += 0.1
    assert admitted == 100
    clock.now += 60.0  # every record has left the window
    assert limits.peek_endpoint(1, 100).remaining == 100
    # A steady rate at the limit: never more than 100 in any 60 s, and a slot
    # frees at most 60/ring = 7.5 s late, so at least 100 per 67.5 s get in.
    times = []
    for _ in range(300):  # 100/min for 3 minutes, one hit per 0.6 s
        if limits.hit_endpoint(1, 100).allowed:
            times.append(clock.now)
        clock.now += 0.6
    assert max(sum(1 for t in times if start <= t < start + 60) for start in times) == 100
    assert len(times) >= int(300 * 60 / 67.5)


def test_keys_beyond_the_table_fall_back_to_the_process_memory(tmp_path: Path) -> None:
    clock = Clock()
    limits, windows = _limits(tmp_path, clock, slots=16)
    keys = [f"auth:192.0.2.{n}" for n in range(PROBE + 8)]
    for key in keys:  # more live keys than slots: some are counted in this process only
        for _ in range(3):
            assert limits.hit_key(key, 3).allowed
        assert not limits.hit_key(key, 3).allowed
    clock.now += 61.0  # expired slots are reused
    assert all(limits.hit_key(key, 3).allowed for key in keys)
    start = time.monotonic()
    assert windows.hit("ep:1", 1) == (True, 1, clock.now, clock.now)
    assert time.monotonic() - start < 5  # no probing loop gone astray


def test_a_key_without_a_slot_gets_each_fronts_share_of_its_limit(tmp_path: Path) -> None:
    # Outside review, session 19: once a flood of failed secrets from many
    # addresses had filled the table, every new key (another guild's quota,
    # another address's throttle) was counted in each front's own memory,
    # against the whole limit: N fronts admitted N times the limit. Now each
    # front counts such a key against its share, so the node admits no more.
    clock = Clock()
    windows = SharedWindows(slots=16, clock=clock, fronts=4)
    filler = RateLimits(clock=clock, windows=windows)
    for n in range(64):   # live keys in every slot
        filler.hit_key(f"auth:192.0.2.{n}", 20)
    admitted = _admitted_by_forks(windows, clock)
    assert 0 < admitted <= 30   # 4 x 7 here: each front's share, 30 // 4
    refused = RateLimits(clock=clock, windows=windows)
    for _ in range(7):
        refused.hit_endpoint(8, 30)
    last = refused.hit_endpoint(8, 30)
    assert not last.allowed and last.remaining == 0


@pytest.mark.parametrize("fronts", [2, 3, 6, 21, 32])
def test_without_a_slot_the_throttle_engages_and_a_small_quota_admits(fronts: int) -> None:
    """Outside review, session 21: with the table full, a key without a slot
    got `limit // fronts` in each front. For a number of fronts that does not
    divide the throttle's 20 (3, 6, ...) the node's count never reached 20, so
    an address was never throttled; from 21 fronts the share was 0, so no
    failure was even counted, and a quota below the number of fronts refused
    every request. Now a front's used share counts as the whole limit, and a
    share is at least 1."""
    clock = Clock()
    windows = SharedWindows(slots=16, clock=clock, fronts=fronts)
    limits = RateLimits(clock=clock, windows=windows)
    for n in range(64):   # live keys in every slot
        limits.hit_key(f"auth:192.0.2.{n}", 20)
    ip = "198.51.100.7"
    failures = 0
    while not limits.auth_throttled(ip):
        limits.auth_failed(ip)
        failures += 1
        assert failures <= AUTH_FAILURES_PER_MINUTE, "never throttled"
    # Every front throttles after its share: the node never admits more than 20
    # failures (or one per front, beyond 20 fronts).
    assert failures * fronts <= max(AUTH_FAILURES_PER_MINUTE, fronts)
    quota = limits.hit_endpoint(9, 10)       # a 10/min quota, also without a slot
    assert quota.allowed


def test_a_refund_gives_back_the_requests_own_record(tmp_path: Path) -> None:
    """The shared table refunds the record that holds the request's own hit
    (the newer records move down), as the in-process windows do."""
    from tests.service.http.test_ratelimit import _refund_scenario
    clock = Clock()
    limits, _ = _limits(tmp_path, clock)
    _refund_scenario(limits, clock)

