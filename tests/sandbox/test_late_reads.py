"""A reply that waits unread past its deadline (real workers).

The pool's deadline ticker and the workers' readers run on the event loop.
When a turn of the loop stalls (a large body decoded, the records writer
holding the interpreter) a tick due in the same turn runs before the reader
of a worker whose reply came in time: the job must count as answered, not as
a time-out of a script that did nothing wrong. Each test stalls the loop with
a job in flight, then runs the tick first, as that turn of the loop would.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from sandbox.pool import Limits, Pool
from tests.sandbox.poolkit import ECHO, event, ref, run_with_pool

BUSY = """\
on endpoint(event):
    total = 0
    for i in range(event.body["n"]):
        total += i
    event.reply(total)
"""


SPIN = """\
on endpoint(event):
    while True:
        pass
"""


def _stall(seconds: float) -> None:
    """The loop's thread busy elsewhere: nothing of the pool runs meanwhile."""
    time.sleep(seconds)


def test_a_reply_in_time_read_after_a_stall_is_the_answer() -> None:
    async def scenario(pool: Pool) -> Any:
        script = ref(ECHO)
        first = await pool.run(script, event(), Limits(100, 4096), guild="G")
        assert first.status == 200
        pid = sorted(pool.worker_pids)
        future = pool.submit(script, event({"n": 4}), Limits(100, 4096), guild="G")
        _stall(0.4)           # the reply arrives within a few ms, and waits
        pool._tick()          # the tick's turn before the reader's
        out = await future
        again = await pool.run(script, event({"n": 5}), Limits(100, 4096), guild="G")
        return out, again, pid, sorted(pool.worker_pids), pool.counters["timeouts"]

    out, again, before, after, timeouts = run_with_pool(scenario, size=1)
    assert out.status == 200 and out.error_kind is None, out
    assert out.body == b'{"ok":true,"double":8}'
    assert again.status == 200
    assert timeouts == 0
    assert before == after   # nobody was killed for a job it answered


def test_a_script_past_its_limit_read_after_a_stall_is_still_a_timeout() -> None:
    async def scenario(pool: Pool) -> Any:
        script = ref(BUSY)
        n = 200_000
        while True:   # a run long enough to measure on this host
            probe = await pool.run(script, event({"n": n}), Limits(20_000, 4096), guild="G")
            assert probe.status == 200, probe
            if probe.duration_ms >= 90 or n > 50_000_000:
                break
            n *= 2
        limit = max(int(probe.duration_ms / 3), 20)
        future = pool.submit(script, event({"n": n}), Limits(limit, 4096), guild="G")
        # Its worker's timer fires at the limit (it says where the script was);
        # the script goes on and replies; nothing reads either until the tick.
        _stall(3 * probe.duration_ms / 1000 + 0.5)
        pool._tick()
        return await future, limit

    out, limit = run_with_pool(scenario, size=1)
    assert out.status == 504 and out.error_kind == "script_timeout", out
    assert f"longer than {limit} ms" in (out.error_message or "")


def test_a_script_the_cpu_backstop_ended_during_a_stall_is_a_timeout_not_a_crash() -> None:
    # The stall outlasted the limit and the kernel's CPU backstop (limit + 3 s):
    # read first, the worker's end read as a crash, and three of them
    # quarantined the version (review, session 29). The tick's verdict stands.
    async def scenario(pool: Pool) -> Any:
        first = await pool.run(ref(SPIN), event(), Limits(100, 4096), guild="G")
        assert first.error_kind == "script_timeout"   # its code is cached now
        outs = []
        for _ in range(2):
            future = pool.submit(ref(SPIN), event(), Limits(100, 4096), guild="G")
            _stall(4.5)
            pool._tick()
            outs.append(await asyncio.wait_for(future, 10))
            await asyncio.sleep(0.5)   # a spare replaces the worker
        return outs, pool.counters

    outs, counters = run_with_pool(scenario, size=1, queue_timeout_ms=20_000)
    for out in outs:
        assert out.status == 504 and out.error_kind == "script_timeout", out
        assert "stopped at line" in (out.error_message or ""), out.error_message
    assert counters["crashes"] == 0 and counters["timeouts"] == 3


def test_the_tick_still_times_out_a_job_with_nothing_to_read() -> None:
    async def scenario(pool: Pool) -> Any:
        script = ref(BUSY)
        future = pool.submit(script, event({"n": 10**12}), Limits(100, 4096), guild="G")
        return await asyncio.wait_for(future, 10)

    out = run_with_pool(scenario, size=1)
    assert out.status == 504 and out.error_kind == "script_timeout", out


def test_a_request_waiting_behind_a_reply_read_late_is_not_refused_busy() -> None:
    async def scenario(pool: Pool) -> Any:
        script = ref(ECHO)
        assert (await pool.run(script, event(), Limits(1000, 4096), guild="G")).status == 200
        first = pool.submit(script, event({"n": 1}), Limits(1000, 4096), guild="G")
        second = pool.submit(script, event({"n": 2}), Limits(1000, 4096), guild="G")
        _stall(0.5)   # past the second's queue timeout; the first's answer waits unread
        pool._tick()
        return await first, await second

    first, second = run_with_pool(scenario, size=1, queue_timeout_ms=200)
    assert first.status == 200
    assert second.status == 200 and second.body == b'{"ok":true,"double":4}', second
