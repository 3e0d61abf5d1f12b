"""A script stopped by its time limit or memory cap reports the script line it
was executing and its script frames (real workers; the kill is unchanged)."""
from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

from sandbox.pool import Limits, Pool
from tests.sandbox.poolkit import event, ref, run_with_pool

SPIN = """\
def spin(n):
    total = 0
    while True:
        total += n
"""
LOOP_IN_FUNCTION = SPIN + """\
on endpoint(event):
    x = 1
    spin(x)
"""

ALLOCATION = """\
on endpoint(event):
    keep = []
    for i in range(10):
        keep.append(i)
    big = bytearray(64 * 1024 * 1024)
    event.reply(len(big))
"""


def test_a_timeout_names_the_line_and_the_script_frames() -> None:
    async def scenario(pool: Pool) -> Any:
        out = await pool.run(ref(LOOP_IN_FUNCTION), event(), Limits(300, 4096), guild="G")
        return out, pool.counters["timeouts"]

    out, timeouts = run_with_pool(scenario, size=1)
    assert out.error_kind == "script_timeout" and out.status == 504
    # The loop's body or its test: the script was killed inside `spin`.
    assert out.error_line in (3, 4), out
    assert "stopped at line" in (out.error_message or "")
    tb = out.traceback or ""
    assert "line 7, in" in tb and "spin(x)" in tb, tb        # the call in the block ...
    assert "in spin" in tb and tb.endswith("stopped by the time limit"), tb  # ... and the loop
    # The kill is unchanged: the supervisor ended it and counted a timeout.
    assert timeouts == 1


def test_a_timeout_in_a_c_level_operation_still_times_out() -> None:
    # The report runs between bytecodes; a long C call ends by the kill alone.
    source = "import re\non endpoint(event):\n    re.match('(a+)+$', 'a' * 40 + 'b')\n"

    async def scenario(pool: Pool) -> Any:
        return await pool.run(ref(source), event(), Limits(300, 4096), guild="G")

    out = run_with_pool(scenario, size=1)
    assert out.error_kind == "script_timeout"


def test_memory_cap_names_the_allocating_line() -> None:
    async def scenario(pool: Pool) -> Any:
        return await pool.run(ref(ALLOCATION), event(), Limits(1000, 4096), guild="G")

    out = run_with_pool(scenario, size=1)
    assert out.error_kind == "script_memory_exceeded"
    assert out.error_line == 5, out
    assert "bytearray(64 * 1024 * 1024)" in (out.traceback or ""), out.traceback


def test_a_script_that_ends_just_in_time_is_unaffected() -> None:
    source = "import time\non endpoint(event):\n    event.reply('done')\n"

    async def scenario(pool: Pool) -> Any:
        return [await pool.run(ref(source), event(), Limits(300, 4096), guild="G")
                for _ in range(20)]

    assert all(o.error_kind is None and o.body == b'"done"' for o in run_with_pool(scenario, size=1))


SPIN_WHEN_ASKED = SPIN + """\
on endpoint(event):
    if event.body.get("spin"):
        spin(1)
    event.reply("quick")
"""


def test_a_job_that_reaches_its_worker_late_still_reports_where_it_stopped() -> None:
    # On a busy host the worker may read its job well after the supervisor sent
    # it, and the supervisor's kill counts from the send: the worker's report of
    # where the script was must come by then, not a time limit after the read.
    async def scenario(pool: Pool) -> Any:
        first = await pool.run(ref(SPIN_WHEN_ASKED), event({}), Limits(300, 4096), guild="G")
        assert first.body == b'"quick"', first
        (worker,) = pool._guild_idle["G"]
        os.kill(worker.pid, signal.SIGSTOP)      # it reads its next job 150 ms late
        loop = asyncio.get_running_loop()
        loop.call_later(0.15, os.kill, worker.pid, signal.SIGCONT)
        out = await pool.run(ref(SPIN_WHEN_ASKED), event({"spin": True}), Limits(300, 4096),
                             guild="G")
        return out, worker.pid, pool.counters["timeouts"]

    out, pid, timeouts = run_with_pool(scenario, size=1)
    assert out.error_kind == "script_timeout" and timeouts == 1
    assert out.error_line in (3, 4), out
    assert "stopped at line" in (out.error_message or "")
    assert "in spin" in (out.traceback or ""), out.traceback
