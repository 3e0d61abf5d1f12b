"""Where requests wait for a worker process, and which idle worker is retired
to make room (sandbox.placement), on real workers."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from sandbox.errors import PoolBusyError
from sandbox.pool import Limits, Pool
from tests.sandbox.poolkit import ECHO, LIMITS, event, ref, run_with_pool


def _guild_pids(pool: Pool, guild: str) -> set[int]:
    return {w.pid for w in pool._workers.values() if w is not None and w.guild == guild}


async def _spares_ready(pool: Pool, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(pool._idle) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert len(pool._idle) >= n


def _slow_spares(pool: Pool, seconds: float) -> None:
    """From now on the pool learns of each new worker ``seconds`` late (a slow process start)."""
    loop = asyncio.get_running_loop()
    deliver = pool._on_spare
    pool._on_spare = lambda w: loop.call_later(seconds, deliver, w)  # type: ignore[method-assign,assignment]


async def _b_takes_the_spare(pool: Pool, start_s: float | None) -> "asyncio.Future[Any]":
    """Guild B's request takes the ready spare; from then on each process start
    takes ``start_s`` (None: as fast as it is)."""
    await _spares_ready(pool, 1)
    if start_s is not None:
        _slow_spares(pool, start_s)
    return pool.submit(ref(ECHO), event(), LIMITS, guild="B")


def test_a_request_waiting_for_its_guilds_first_worker_holds_no_run_slot() -> None:
    """One run slot; guild C needs a process start, made slow here (0.8 s):
    guild A, whose worker is warm and whose request came after C's, runs meanwhile."""
    async def scenario(pool: Pool) -> None:
        loop = asyncio.get_running_loop()
        assert (await pool.run(ref(ECHO), event(), LIMITS, guild="A")).error_kind is None
        b = await _b_takes_the_spare(pool, 0.8)
        c = pool.submit(ref(ECHO), event(), LIMITS, guild="C")   # queued: the slot is B's
        t0 = loop.time()
        a = await pool.run(ref(ECHO), event(), LIMITS, guild="A")  # queued behind C
        a_done = loop.time() - t0
        outs = [await b, await c]
        c_done = loop.time() - t0
        assert a.error_kind is None and all(o.error_kind is None for o in outs)
        assert a_done < 0.5 <= c_done, (a_done, c_done)
        assert pool._sched.running == 0 and not pool._homeless

    run_with_pool(scenario, size=1, max_workers=8)


def test_a_request_that_waited_for_its_worker_still_times_out_busy() -> None:
    """Back in the queue after its worker started, a request has the queue
    timeout again: behind a script holding the only slot it is refused busy,
    not kept until that script's time limit."""
    spin = "on endpoint(event):\n    while True:\n        pass\n"
    long = Limits(time_ms=2000, memory_kb=512)

    async def scenario(pool: Pool) -> None:
        loop = asyncio.get_running_loop()
        assert (await pool.run(ref(ECHO), event(), LIMITS, guild="H")).error_kind is None
        b = await _b_takes_the_spare(pool, 0.3)    # takes the spare and the slot
        t0 = loop.time()
        waiting = pool.submit(ref(ECHO), event(), LIMITS, guild="W")  # next: waits for a start
        hog = pool.submit(ref(spin), event(), long, guild="H")       # then holds the slot 2 s
        assert (await b).error_kind is None
        with pytest.raises(PoolBusyError):
            await waiting
        assert loop.time() - t0 < 1.5, loop.time() - t0   # 0.3 s start + 0.6 s queue timeout
        assert (await hog).error_kind == "script_timeout"

    run_with_pool(scenario, size=1, max_workers=8, queue_timeout_ms=600)


def test_guilds_called_once_make_room_for_each_other_before_a_popular_guilds_worker_goes() -> None:
    async def scenario(pool: Pool) -> None:
        for _ in range(3):
            assert (await pool.run(ref(ECHO), event(), LIMITS, guild="popular")).error_kind is None
        popular = _guild_pids(pool, "popular")
        for i in range(12):
            out = await pool.run(ref(ECHO), event(), LIMITS, guild=f"once{i}")
            assert out.error_kind is None, out.error_message
        assert pool.counters["retired"] >= 8          # room was made again and again ...
        assert _guild_pids(pool, "popular") == popular  # ... never from the popular guild

    run_with_pool(scenario, size=1, max_workers=4)


def test_one_request_a_guild_waits_for_a_worker_and_the_rest_stay_queued() -> None:
    """The guild's other requests stay in the queue (its limit and timeout
    apply to them) while one waits for the guild's worker; then all run."""
    async def scenario(pool: Pool) -> None:
        assert (await pool.run(ref(ECHO), event(), LIMITS, guild="A")).error_kind is None
        b = await _b_takes_the_spare(pool, 0.5)
        gs = [pool.submit(ref(ECHO), event(), LIMITS, guild="G") for _ in range(4)]
        await asyncio.sleep(0.2)                                     # B is done; G waits
        assert list(pool._homeless) == ["G"]
        assert pool._sched.waiting == 3 and pool._sched.running == 0
        outs = [await f for f in (b, *gs)]
        assert all(o.error_kind is None for o in outs), [o.error_message for o in outs]
        assert not pool._homeless and pool._sched.waiting == 0

    run_with_pool(scenario, size=1, max_workers=8)


def test_a_request_whose_worker_never_comes_is_refused_busy_and_can_be_withdrawn() -> None:
    async def scenario(pool: Pool) -> None:
        loop = asyncio.get_running_loop()
        b = await _b_takes_the_spare(pool, None)       # takes the spare
        pool._on_spare = lambda w: None  # type: ignore[method-assign]  # no worker comes
        t0 = loop.time()
        stuck = pool.submit(ref(ECHO), event(), LIMITS, guild="G")
        assert (await b).error_kind is None
        with pytest.raises(PoolBusyError):
            await stuck
        assert loop.time() - t0 < 1.2, loop.time() - t0              # the 0.5 s queue timeout
        assert not pool._homeless and not pool._sched.guilds["G"].held
        left = pool.submit(ref(ECHO), event(), LIMITS, guild="H")    # waits for a worker ...
        await asyncio.sleep(0.05)
        assert "H" in pool._homeless
        assert pool.withdraw(left) and left.cancelled()               # ... until its client leaves
        assert not pool._homeless and pool._sched.running == 0

    run_with_pool(scenario, size=1, max_workers=8, queue_timeout_ms=500)


def test_a_guild_with_a_backlog_does_not_keep_the_only_worker_from_a_waiting_guild() -> None:
    """One process in all: guild A keeps a backlog; G's one request still gets
    a worker (A's idle one is retired for it) long before A's backlog ends."""
    async def scenario(pool: Pool) -> None:
        assert (await pool.run(ref(ECHO), event(), LIMITS, guild="A")).error_kind is None
        flood = [pool.submit(ref(ECHO), event(), LIMITS, guild="A") for _ in range(40)]
        g = pool.submit(ref(ECHO), event(), LIMITS, guild="G")
        out = await g
        assert out.error_kind is None, out.error_message
        assert sum(not f.done() for f in flood) > 5     # G did not wait for A's backlog
        rest = [await f for f in flood]
        assert all(o.error_kind is None for o in rest), [o.error_message for o in rest]

    run_with_pool(scenario, size=1, max_workers=1, queue_timeout_ms=20000)


def test_a_second_seated_request_of_a_waiting_guild_waits_in_its_queue() -> None:
    """A request of the guild that was seated before (as one whose code was
    being compiled is) and finds no worker while another of its guild waits
    for one goes first in the guild's queue; both run once the worker is up."""
    from sandbox.channel import RequestState
    from sandbox.codecache import source_digest

    async def scenario(pool: Pool) -> None:
        loop = asyncio.get_running_loop()
        b = await _b_takes_the_spare(pool, 0.4)       # takes the spare
        first = pool.submit(ref(ECHO), event(), LIMITS, guild="G")
        assert (await b).error_kind is None
        await asyncio.sleep(0.05)
        assert "G" in pool._homeless
        script = ref(ECHO)
        second = RequestState(loop.create_future(), "job", script, event(), LIMITS, "G")
        second.dig = source_digest(script.key, script.version, script.source)
        second.seated = True
        pool._sched.running += 1
        pool._sched.guilds["G"].running += 1
        pool._seat(second)
        assert second.queued and not second.seated and pool._sched.running == 0
        outs = [await first, await second.future]
        assert all(o.error_kind is None for o in outs), [o.error_message for o in outs]

    run_with_pool(scenario, size=1, max_workers=8)
