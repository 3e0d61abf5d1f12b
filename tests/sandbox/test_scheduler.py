"""The pool's fair queue (sandbox.scheduler) on its own: pure bookkeeping, a fake clock.

The pool-level behaviour (timeouts, cancellation, real workers) is in
test_tenancy.py; these tests pin the rules the pool relies on.
"""
from __future__ import annotations

import pytest

from sandbox.scheduler import Scheduler


class Req:
    def __init__(self, guild: str, n: int) -> None:
        self.guild = guild
        self.n = n
        self.queued = False
        self.deprioritised = False

    def __repr__(self) -> str:
        return f"{self.guild}{self.n}"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fill(s: Scheduler, guild: str, n: int) -> list[Req]:
    """Start ``n`` of ``guild``'s requests, queueing those that cannot start now."""
    out = []
    for i in range(n):
        r = Req(guild, i)
        if s.can_start_now():
            s.start(guild)
        else:
            s.push(r)
        out.append(r)
    return out


@pytest.mark.parametrize("size,cap", [(1, 1), (2, 1), (8, 4)])
def test_share_cap(size: int, cap: int) -> None:
    s = Scheduler(size, share=0.5, budget_s=0)
    assert s.cap == cap
    running = [r.guild for r in fill(s, "A", size)]   # alone, A took every slot
    assert s.running == size
    for i in range(50):
        s.push(Req("A", 100 + i))
        s.push(Req("B", i))
    served = {"A": 0, "B": 0}
    for step in range(60):
        s.finish(running.pop(0), 0.0)          # the oldest job ends
        r = s.pop()
        assert r is not None
        running.append(r.guild)
        served[r.guild] += 1
        if step >= size:                       # A's excess has been given back
            assert s.guilds["A"].running <= cap and s.guilds["B"].running <= cap
    assert abs(served["A"] - served["B"]) <= size


def test_round_robin_between_guilds_fifo_within() -> None:
    s = Scheduler(1, share=0.5, budget_s=0)
    s.start("X")  # the only slot is busy
    for g in "ABC":
        for i in range(3):
            s.push(Req(g, i))
    order = []
    for _ in range(9):
        s.finish(order[-1][0] if order else "X", 0.0)
        r = s.pop()
        assert r is not None
        order.append(repr(r))
    assert order == ["A0", "B0", "C0", "A1", "B1", "C1", "A2", "B2", "C2"]


def test_a_lone_guild_uses_every_slot_and_gives_the_excess_back() -> None:
    # Stated policy: a guild alone may use more than its share (nobody waits);
    # once another guild waits, the alone guild gets no new slot until it is
    # back under its cap.
    s = Scheduler(8, share=0.5, budget_s=0)
    fill(s, "A", 8)
    assert s.guilds["A"].running == 8 and s.waiting == 0
    a_more = [Req("A", 100 + i) for i in range(10)]
    for r in a_more:
        s.push(r)
    b = [Req("B", i) for i in range(4)]
    for r in b:
        s.push(r)
    got = []
    for _ in range(4):
        s.finish("A", 0.0)
        r = s.pop()
        assert r is not None
        got.append(r.guild)
    assert got == ["B", "B", "B", "B"]          # A is at 4 running = its cap
    s.finish("A", 0.0)
    r = s.pop()
    assert r is not None and r.guild == "A"     # nobody else waits: A again


def test_cancel_takes_a_request_out_at_once() -> None:
    s = Scheduler(1, budget_s=0)
    s.start("A")
    r1, r2 = Req("B", 1), Req("B", 2)
    s.push(r1)
    s.push(r2)
    assert s.cancel(r1) and not r1.queued and s.waiting == 1
    assert not s.cancel(r1)  # twice is harmless
    s.finish("A", 0.0)
    assert s.pop() is r2
    assert s.pop() is None


def test_a_guild_in_debt_is_served_only_when_nobody_else_waits() -> None:
    clock = Clock()
    s = Scheduler(2, share=0.5, budget_s=10.0, window_s=60.0, clock=clock)
    s.start("A")
    s.start("B")
    # A's job took 11 worker-seconds: over its 10 s budget.
    assert s.finish("A", 11.0) is True           # first time: the pool logs it
    assert s.standing("A") < 0
    a, b = Req("A", 1), Req("B", 1)
    s.push(a)
    s.push(b)
    assert a.deprioritised and not b.deprioritised
    assert s.pop() is b                           # B first although A queued earlier
    s.finish("B", 0.0)
    s.finish("B", 0.0)
    assert s.pop() is a                           # nobody else waits: A is served
    # The budget refills: 60 s later A is in good standing again.
    clock.now += 60.0
    assert s.standing("A") > 0


def test_debt_is_logged_once_and_refilled_guilds_come_back() -> None:
    clock = Clock()
    s = Scheduler(1, share=1.0, budget_s=6.0, window_s=60.0, clock=clock)  # 0.1 s per s
    s.start("A")
    assert s.finish("A", 7.0) is True
    s.start("A")
    assert s.finish("A", 1.0) is False            # still in debt: not reported again
    s.start("B")
    s.push(Req("A", 1))
    s.push(Req("B", 2))
    clock.now += 30.0                             # A refilled to +1 s
    s.finish("B", 0.0)
    first = s.pop()
    assert first is not None and first.guild == "B"   # B's turn came first
    s.push(Req("B", 3))
    s.finish("B", 0.0)
    r = s.pop()
    assert r is not None and r.guild == "A"       # re-examined and back in the turn


def test_sweep_forgets_idle_guilds_with_a_full_budget() -> None:
    clock = Clock()
    s = Scheduler(1, budget_s=6.0, clock=clock)
    s.start("A")
    s.finish("A", 3.0)
    s.sweep()
    assert "A" in s.guilds                        # still paying back
    clock.now += 60.0
    s.sweep()
    assert "A" not in s.guilds


def test_bad_settings_are_refused() -> None:
    for kwargs in ({"size": 0}, {"size": 1, "share": 0.0}, {"size": 1, "share": 1.5},
                   {"size": 1, "budget_s": -1}):
        with pytest.raises(ValueError):
            Scheduler(**kwargs)  # type: ignore[arg-type]
