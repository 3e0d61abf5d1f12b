"""The pool's memory budget on real workers: how many guild workers it keeps,
and that a worker that grew is charged for what it grew.

``max_workers`` is set far above what the budget holds in every test, so each
one fails on a pool that only counts processes.
"""
from __future__ import annotations

import asyncio
import time

from sandbox.budget import WORKER_BYTES, derived_max_workers
from sandbox.pool import Pool
from tests.sandbox.poolkit import ECHO, LIMITS, event, ref, run_with_pool


def _bound_pids(pool: Pool) -> dict[str, int]:
    return {w.guild: w.pid for w in pool._workers.values()
            if w is not None and w.guild not in (None, "\x00compile")}


async def _settle(pool: Pool, seconds: float = 4.0) -> None:
    """Let housekeeping (once a second) run until the estimate is under budget."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        if pool.memory_estimate() <= pool.memory_budget:
            await asyncio.sleep(1.2)   # one more round: it must stay there
            return


def test_the_pool_keeps_only_as_many_workers_as_its_memory_budget_holds() -> None:
    budget_workers = 6

    async def scenario(pool: Pool) -> None:
        for round_ in range(3):
            for g in range(14):
                out = await pool.run(ref(ECHO), event(), LIMITS, guild=f"g{g}")
                assert out.error_kind is None, out.error_message
                # Never more processes than the budget holds (spawning slots included).
                assert len(pool._workers) <= budget_workers + 1, (round_, g, len(pool._workers))
        await _settle(pool)
        assert pool.memory_estimate() <= pool.memory_budget
        assert pool.counters["retired"] > 0   # room was made by retiring, not by growing

    run_with_pool(scenario, size=1, max_workers=100,
                  memory_budget_mb=budget_workers * WORKER_BYTES >> 20)


# A script whose compiled form holds ~180 KB: every version a worker keeps in its
# cache of compiled scripts stays resident (the worker's own, real growth).
BIG = ("on endpoint(event):\n    blob = (\n"
       + "".join(f'        "{chr(97 + i % 26) * 900}"\n' for i in range(200))
       + "    )\n    event.reply({'n': len(blob) + VERSION})\n")


def test_a_worker_that_grew_is_charged_for_it_and_retired_before_lean_ones() -> None:
    async def scenario(pool: Pool) -> None:
        for v in range(60):
            src = BIG.replace("VERSION", str(v))
            out = await pool.run(ref(src, key="logic_fat", version=v + 1), event(), LIMITS,
                                 guild="fat")
            assert out.error_kind is None, out.error_message
        fat = [w for w in pool._workers.values() if w is not None and w.guild == "fat"]
        assert len(fat) == 1
        grown = fat[0].rss_last - fat[0].rss_first
        assert grown > 2 * WORKER_BYTES, grown        # it reported what it kept
        fat_pid = fat[0].pid
        assert pool.memory_estimate() >= len(pool._workers) * WORKER_BYTES + grown
        # Lean guilds arrive, and the fat guild is used again in between, so it
        # is not the least recently used: the estimate passes the budget and
        # housekeeping retires the worker that grew, not the lean ones.
        for g in range(4):
            assert (await pool.run(ref(ECHO), event(), LIMITS, guild=f"lean{g}")).status == 200
            if g == 1:
                src = BIG.replace("VERSION", "59")
                assert (await pool.run(ref(src, key="logic_fat", version=60), event(), LIMITS,
                                       guild="fat")).status == 200
        await _settle(pool)
        pids = _bound_pids(pool)
        assert "fat" not in pids and fat_pid not in pids.values(), pids
        assert all(f"lean{g}" in pids for g in range(4)), pids
        assert pool.memory_estimate() <= pool.memory_budget

    # Room for 8 lean workers; the fat one alone counts for more than 3.
    run_with_pool(scenario, size=1, max_workers=100, memory_budget_mb=8 * WORKER_BYTES >> 20)


def test_the_derived_worker_count_follows_the_memory_budget() -> None:
    assert derived_max_workers(2, 100 * WORKER_BYTES) == 100
    assert derived_max_workers(2, 10 * WORKER_BYTES) == 10
    assert derived_max_workers(8, WORKER_BYTES) == 16          # at least twice the run slots
    assert derived_max_workers(2, 1 << 50) <= 4096


def test_a_pool_whose_descriptors_pass_1024_starts_serves_and_stops() -> None:
    """A budget of thousands of workers puts their descriptors past select()'s
    limit of 1024: starting, serving and stopping must not depend on it."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        import pytest
        pytest.skip(f"the hard descriptor limit ({hard}) is below 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))

        async def scenario(pool: Pool) -> None:
            for g in range(3):
                out = await pool.run(ref(ECHO), event(), LIMITS, guild=f"g{g}")
                assert out.error_kind is None, out.error_message
            assert min(w.sock.fileno() for w in pool._workers.values() if w is not None) > 1024

        run_with_pool(scenario, size=2)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
