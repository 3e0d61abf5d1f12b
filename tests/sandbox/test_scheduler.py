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
        self.excess = False

    def __repr__(self) -> str:
        return f"{self.guild}{self.n}"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Sim:
    """The pool's use of the scheduler, with jobs that end when told to."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.running: list[tuple[str, bool]] = []   # (guild, excess), oldest first
        self.served: list[str] = []
        self.n = 0

    def submit(self, guild: str) -> Req:
        self.n += 1
        r = Req(guild, self.n)
        if not self.s.waiting:
            kind = self.s.start(guild)
            if kind >= 0:
                self.running.append((guild, kind == 1))
                return r
        self.s.push(r)
        self.pump()
        return r

    def pump(self) -> None:
        while True:
            r = self.s.pop()
            if r is None:
                return
            self.running.append((r.guild, r.excess))
            self.served.append(r.guild)

    def end(self, guild: str | None = None, cost: float = 0.0) -> bool:
        i = 0 if guild is None else next(i for i, (g, _) in enumerate(self.running) if g == guild)
        g, excess = self.running.pop(i)
        fell = self.s.finish(g, cost, excess)
        self.pump()
        return fell

    def count(self, guild: str) -> int:
        return sum(1 for g, _ in self.running if g == guild)


@pytest.mark.parametrize("size,cap", [(1, 1), (2, 1), (8, 4)])
def test_share_cap(size: int, cap: int) -> None:
    sim = Sim(Scheduler(size, share=0.5, budget_s=0))
    assert sim.s.cap == cap
    for _ in range(size + 50):
        sim.submit("A")                          # alone, A takes every slot, queues the rest
    assert sim.count("A") == size and sim.s.waiting == 50
    for _ in range(50):
        sim.submit("B")
    # B runs at once beside A's excess (A had size - cap of it), up to its own share.
    assert sim.count("B") == min(cap, size - cap)
    for _ in range(80):
        sim.end()                                # the oldest job ends
        assert sim.count("A") <= size and sim.count("B") <= cap
    # From here on each guild holds its share only.
    assert sim.count("A") <= cap and sim.count("B") <= cap
    assert sim.s.running <= 2 * size
    assert abs(sim.served.count("A") - sim.served.count("B")) <= size


def test_round_robin_between_guilds_fifo_within() -> None:
    s = Scheduler(2, share=0.5, budget_s=0)
    sim = Sim(s)
    sim.submit("X")
    sim.submit("X")                              # both slots busy with X (1 fair, 1 excess)
    reqs = [Req(g, i) for i in range(3) for g in "ABC"]
    for r in reqs:
        s.push(r)
    assert s.waiting == 9 and all(r.queued for r in reqs)
    order = []
    for _ in range(9):
        sim.end()
        while sim.served:
            order.append(sim.served.pop(0))
    # One slot at a time (the fair room): A, B, C in turn, each guild's in order.
    assert "".join(order) == "ABCABCABC"


def test_a_resumed_request_goes_first_in_its_guild_and_its_guild_first_in_turn() -> None:
    """A request that had its turn and gave its slot back while its worker
    started (the pool's ``_resume``) is not sent to the end of the line."""
    s = Scheduler(2, share=0.5, budget_s=0)
    sim = Sim(s)
    sim.submit("X")
    sim.submit("X")                              # both slots busy
    queued = [Req(g, i) for i in range(2) for g in "ABC"]
    for r in queued:
        s.push(r)
    resumed = [Req("C", 8), Req("C", 9)]
    for r in reversed(resumed):                  # as the pool resumes a guild's requests
        s.push(r, resume=True)
    assert [r.n for r in s.guilds["C"].queue] == [8, 9, 0, 1]
    order = []
    for _ in range(8):
        sim.end()
        while sim.served:
            order.append(sim.served.pop(0))
    assert "".join(order) == "CABCABCC"          # C first, then the turn goes on
    assert not any(r.queued for r in queued + resumed)


def test_a_held_guild_is_served_again_only_once_released() -> None:
    """While one of its requests waits for a worker process, the pool holds a
    guild: its other requests wait in its queue (not handed slots to give back)."""
    s = Scheduler(2, share=0.5, budget_s=0)
    sim = Sim(s)
    s.hold("G")
    assert s.start("G") == -1                    # not even a free slot serves it
    sim.submit("G")
    sim.submit("G")
    sim.submit("A")
    assert sim.served == ["A"] and s.waiting == 2
    s.release("G")
    sim.pump()
    assert sim.served == ["A", "G"] and s.waiting == 1   # one more slot was free
    s.sweep()
    assert "G" in s.guilds


def test_a_lone_guild_uses_every_slot_and_gives_the_excess_back() -> None:
    # Stated policy: a guild alone may use every slot (nobody waits). Once
    # another guild has work, the newcomer runs within its share beside the
    # excess at once, and the lone guild gets no new slot beyond its share.
    sim = Sim(Scheduler(8, share=0.5, budget_s=0))
    for _ in range(18):
        sim.submit("A")
    assert sim.count("A") == 8 and sim.s.excess == 4 and sim.s.waiting == 10
    for _ in range(4):
        sim.submit("B")
    assert sim.count("B") == 4 and sim.s.running == 12   # beside A's excess
    for _ in range(4):
        sim.end("A")
    assert sim.count("A") == 4                            # back at its share ...
    for _ in range(4):
        sim.end("B")
    assert sim.count("A") == 8                            # ... and alone again: all slots


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


def test_a_full_queue_makes_room_from_the_longest_guild_queue_only() -> None:
    s = Scheduler(1)
    a = [Req("A", n) for n in range(4)]
    for r in a:
        s.push(r)
    s.push(Req("B", 0))
    assert s.crowding("C") is a[-1]          # C has none: A's newest gives way
    assert s.crowding("B") is a[-1]          # B has one, A four
    assert s.crowding("A") is None           # A itself is the longest: refused
    for n in range(1, 3):
        s.push(Req("B", n))
    assert s.crowding("B") is None           # three against four: no ping-pong
    assert s.crowding("D") is a[-1]
