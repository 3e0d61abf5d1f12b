"""Supervision a compromised worker must not escape (review, session 33).

A worker cannot be made to spin or grow here without taking one over, so, as
in ``test_redteam.py::test_an_idle_worker_that_uses_cpu_is_killed``, what is
stood in for is what housekeeping reads of it: its CPU clock (the real
reading plus a second a look, as a spinning worker shows) or its resident
size. Everything else is a real pool with real workers.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest

from sandbox.errors import PoolBusyError
from sandbox.pool import Limits, Pool
from tests.sandbox.poolkit import event, ref, run_with_pool, stand_in_spin_and_growth, wait_for
from tests.sandbox.script_helpers import block

LIMITS = Limits(1000, 4096)


def _run(pool: Pool, guild: str, n: int = 1) -> Any:
    return pool.run(ref(block(f"event.reply({n})"), key=f"logic_{guild}{n}"), event(), LIMITS,
                    guild)


def test_an_idle_compile_worker_that_spins_or_grows_is_replaced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The compile worker was in no idle list, so neither the resident-size
    # check nor the idle-CPU kill ever looked at it: one its guild took over
    # spun for seconds (bounded only by its hour of CPU) or kept 300 MB.
    spinning, growing = stand_in_spin_and_growth(monkeypatch)

    async def scenario(pool: Pool) -> None:
        n = 0
        for marks in (None, spinning, growing):
            n += 1
            out = await _run(pool, "A", n)       # a new version: the compile worker compiles it
            assert out.body == str(n).encode()
            await wait_for(lambda: pool._compiler is not None and pool._compiler.alive
                           and pool._compiler.req is None, 10)
            compiler = pool._compiler
            assert compiler is not None
            if marks is None:
                await asyncio.sleep(2.5)         # two rounds: a quiet one is kept
                assert pool._compiler is compiler and compiler.alive
                continue
            marks.add(compiler.pid)
            await wait_for(lambda: not compiler.alive, 4)
            assert compiler.pid not in pool.worker_pids
        out = await _run(pool, "A", 9)           # and the pool goes on
        assert out.body == b"9"

    run_with_pool(scenario, size=1)


def test_a_worker_that_spins_between_its_guilds_jobs_is_killed_and_charged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A taken-over worker that spins between its jobs, its guild sending one
    # request every 0.3 s, was never "idle with no job done": the kill never
    # came and the CPU was nobody's. The rule now weighs the CPU it used
    # beyond the wall time it held requests, and charges it to its guild.
    spinning, _ = stand_in_spin_and_growth(monkeypatch)

    async def scenario(pool: Pool) -> tuple[float, float]:
        assert (await _run(pool, "A")).body == b"1"
        target = next(w for w in pool._workers.values() if w is not None and w.guild == "A")
        before = pool._sched.standing("A")
        spinning.add(target.pid)
        held = 0.0
        end = time.monotonic() + 6.0
        while target.pid in pool.worker_pids and time.monotonic() < end:
            t0 = time.monotonic()
            out = await _run(pool, "A")
            held += time.monotonic() - t0
            assert out.body == b"1"
            await asyncio.sleep(0.3)
        assert target.pid not in pool.worker_pids and not target.alive
        assert (await _run(pool, "A")).body == b"1"     # a new worker serves the guild
        return held, before - pool._sched.standing("A")

    # (1 s of budget a minute: what is charged is not refilled meanwhile)
    held, spent = run_with_pool(scenario, size=1, guild_budget_s=1.0)
    # The look that killed it showed a second more than it held: charged too.
    assert spent >= held + 0.9, (spent, held)


def test_a_busy_guilds_workers_are_neither_killed_nor_charged_for_their_requests() -> None:
    # The control: real workers serving real requests back to back and with
    # gaps over several rounds use less CPU than the time they held them.
    async def scenario(pool: Pool) -> tuple[set[int], set[int], float, float]:
        assert (await _run(pool, "A")).body == b"1"
        first = set(pool.worker_pids)
        before, held = pool._sched.standing("A"), 0.0
        end = time.monotonic() + 3.5
        n = 0
        while time.monotonic() < end:
            n += 1
            t0 = time.monotonic()
            source = "xs = [str(i) for i in range(20000)]\nevent.reply(len(xs))"
            out = await pool.run(ref(block(source), key="logic_A_big"), event(), LIMITS, "A")
            held += time.monotonic() - t0
            assert out.body == b"20000"
            if n % 4 == 0:
                await asyncio.sleep(0.2)
        return first, set(pool.worker_pids), before - pool._sched.standing("A"), held

    first, after, spent, held = run_with_pool(scenario, size=1, guild_budget_s=1.0)
    assert first <= after                            # none killed
    assert spent <= held + 0.05, (spent, held)


def test_without_the_fork_server_no_warm_worker_is_retired_for_a_new_guild() -> None:
    # With the fork server dead, each new guild's request retired another
    # guild's idle worker to make room for a spare that could never be
    # forked: the pool went from 3 workers to none, and guilds that had a
    # worker got 503 busy too.
    async def scenario(pool: Pool) -> None:
        for g in "AB":
            assert (await _run(pool, g)).body == b"1"
        warm = {w.guild: w.pid for w in pool._workers.values()
                if w is not None and w.guild in ("A", "B")}
        assert set(warm) == {"A", "B"}
        os.kill(pool._zygote_pid, signal.SIGKILL)
        await wait_for(lambda: not pool._zygote_alive, 10)
        for g in "CDE":                          # the last spare, then nothing
            try:
                await _run(pool, g)
            except PoolBusyError:
                pass
        assert set(warm.values()) <= set(pool.worker_pids)
        for g in "AB":
            out = await _run(pool, g)
            assert out.body == b"1", (g, out.error_kind, out.error_message)

    run_with_pool(scenario, size=2, spares=1, max_workers=4, queue_timeout_ms=500)
