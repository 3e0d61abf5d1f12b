"""The pool with real worker processes: results, concurrency, busy, recycle, stop."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from sandbox.channel import WorkerHandle
from sandbox.codecache import source_digest
from sandbox.errors import PoolBusyError, PoolClosedError
from sandbox.pool import Limits, Pool

from tests.sandbox.poolkit import (ECHO, LIMITS, alive, event, job_worker, ref, run_with_pool,
                                  wait_for)

pytestmark = pytest.mark.timeout(60)

LOOP = '''on endpoint(event):
    while True:
        pass
'''
SPIN = '''import time
on endpoint(event):
    start = time.monotonic()
    while time.monotonic() - start < event.body["s"]:
        pass
    event.reply({"slept": event.body["s"]})
'''


def test_runs_a_script_and_maps_the_outcome() -> None:
    async def scenario(pool: Pool) -> None:
        out = await pool.run(ref(ECHO), event({"n": 21}), LIMITS)
        assert out.error_kind is None
        assert out.status == 200 and out.replied
        assert out.body == b'{"ok":true,"double":42}'
        assert out.content_type == "application/json"
        assert out.output == "n is 21\n"
        assert out.duration_ms > 0 and out.peak_memory_bytes > 0
        bad = await pool.run(ref(ECHO), event("text"), LIMITS)
        assert bad.status == 422 and bad.body == b'{"error":"n must be an integer"}'

    run_with_pool(scenario)


def test_never_replied_compile_error_and_no_handler() -> None:
    async def scenario(pool: Pool) -> None:
        quiet = await pool.run(ref("on endpoint(event):\n    x = 1\n", "q"), event(), LIMITS)
        assert (quiet.status, quiet.replied, quiet.body) == (200, False, b'{"success": true}')
        broken = await pool.run(ref("on endpoint(event):\n    x = (\n", "b"), event(), LIMITS)
        assert broken.error_kind == "script_error" and broken.status == 500
        assert broken.error_line is not None
        none = await pool.run(ref("x = 1\n", "n"), event(), LIMITS)
        assert none.error_kind == "no_endpoint_handler" and none.status == 501
        raised = await pool.run(ref("on endpoint(event):\n    x = 1\n    1 / 0\n", "r"),
                                event(), LIMITS)
        assert raised.error_kind == "script_error" and raised.error_line == 3
        assert "ZeroDivisionError" in (raised.error_message or "")
        assert raised.traceback and 'line 3' in raised.traceback

    run_with_pool(scenario)


def test_source_is_sent_once_per_worker_and_version() -> None:
    async def scenario(pool: Pool) -> None:
        sent: list[bool] = []
        job_frame = WorkerHandle.job_frame

        def recording(w: WorkerHandle, req: Any, codes: Any = None) -> bytes:
            frame = job_frame(w, req, codes)
            sent.append(b"on endpoint" in frame)
            return frame

        WorkerHandle.job_frame = recording  # type: ignore[method-assign]
        try:
            first = await pool.run(ref(ECHO, "logic_cache", 1), event({"n": 1}), LIMITS)
            assert first.body == b'{"ok":true,"double":2}'
            again = await pool.run(ref(ECHO, "logic_cache", 1), event({"n": 2}), LIMITS)
            assert again.body == b'{"ok":true,"double":4}'
            # The script went to the worker with the first job only.
            assert sent == [True, False]
            # Same key and version, different text (a restored database): the
            # copy the worker has is bound to the old source and is not run.
            other = "on endpoint(event):\n    event.reply('recompiled')\n"
            changed = await pool.run(ref(other, "logic_cache", 1), event({"n": 2}), LIMITS)
            assert changed.body == b'"recompiled"'
            newer = await pool.run(ref(other, "logic_cache", 2), event({"n": 2}), LIMITS)
            assert newer.body == b'"recompiled"'
        finally:
            WorkerHandle.job_frame = job_frame  # type: ignore[method-assign]

    run_with_pool(scenario, size=1)


def test_worker_asks_for_a_source_it_lacks() -> None:
    async def scenario(pool: Pool) -> None:
        worker = next(w for w in pool._workers.values() if w is not None)
        script = ref(ECHO, "logic_need", 4)
        # The mirror wrongly believes it is cached.
        worker.known[("logic_need", 4, source_digest("logic_need", 4, ECHO))] = None
        out = await pool.run(script, event({"n": 3}), LIMITS)
        assert out.body == b'{"ok":true,"double":6}'
        # Served by the same worker, no crash (the other pid is the spare
        # forked when the first worker was bound to the guild).
        assert worker.alive and worker.jobs == 1 and worker.pid in pool.worker_pids
        assert pool.counters["crashes"] == 0 and pool.counters["restarts"] == 0

    run_with_pool(scenario, size=1)


def test_event_that_cannot_be_encoded_is_refused_without_losing_the_worker() -> None:
    async def scenario(pool: Pool) -> None:
        out = await pool.run(ref(ECHO), {"body": object()}, LIMITS)
        assert out.error_kind == "script_error" and "cannot be sent" in (out.error_message or "")
        ok = await pool.run(ref(ECHO), event(), LIMITS)
        assert ok.error_kind is None and pool.counters["restarts"] == 0

    run_with_pool(scenario, size=1)


def test_500_concurrent_invocations_over_two_workers() -> None:
    async def scenario(pool: Pool) -> None:
        outs = await asyncio.gather(*[pool.run(ref(ECHO), event({"n": i}), LIMITS)
                                      for i in range(500)])
        for i, out in enumerate(outs):
            assert out.body == b'{"ok":true,"double":%d}' % (2 * i)
        assert pool.counters["invocations"] == 500
        assert pool.counters["crashes"] == 0
        # Two run slots: the guild was given exactly two workers.
        assert len([w for w in pool._workers.values() if w is not None and w.guild == ""]) == 2

    run_with_pool(scenario, size=2)


def test_busy_after_queue_timeout_and_when_queue_is_full() -> None:
    async def scenario(pool: Pool) -> None:
        slow = asyncio.ensure_future(pool.run(ref(SPIN), event({"s": 0.6}), LIMITS))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(PoolBusyError):
            await pool.run(ref(ECHO), event(), LIMITS)
        waited = time.monotonic() - t0
        assert 0.15 <= waited < 0.45
        assert (await slow).body == b'{"slept":0.6}'
        assert pool.counters["busy_rejections"] == 1

    run_with_pool(scenario, size=1, queue_timeout_ms=200)

    async def full(pool: Pool) -> None:
        slow = asyncio.ensure_future(pool.run(ref(SPIN), event({"s": 0.2}), LIMITS))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(PoolBusyError):
            await pool.run(ref(ECHO), event(), LIMITS)
        assert time.monotonic() - t0 < 0.05
        await slow

    run_with_pool(full, size=1, max_queue=0)


def test_queued_request_runs_when_a_worker_frees() -> None:
    async def scenario(pool: Pool) -> None:
        slow = asyncio.ensure_future(pool.run(ref(SPIN), event({"s": 0.2}), LIMITS))
        await asyncio.sleep(0.02)
        queued = await pool.run(ref(ECHO), event({"n": 5}), LIMITS)
        assert queued.body == b'{"ok":true,"double":10}', queued
        assert (await slow).error_kind is None

    run_with_pool(scenario, size=1, queue_timeout_ms=2000)


def test_recycle_after_max_jobs() -> None:
    async def scenario(pool: Pool) -> None:
        pids = []
        for i in range(7):
            out = await pool.run(ref(ECHO), event({"n": i}), LIMITS)
            assert out.error_kind is None
            bound = [w.pid for w in pool._workers.values() if w is not None and w.guild == ""]
            pids.append(bound[0] if bound else -1)
            await wait_for(lambda: len(pool._idle) == 1)  # the spare is back
        assert len({p for p in pids if p != -1}) >= 3
        assert pool.counters["restarts"] >= 2

    run_with_pool(scenario, size=1, max_jobs=3, max_jobs_jitter=0)


def test_worker_killed_mid_run_is_a_crash_and_is_replaced() -> None:
    async def scenario(pool: Pool) -> None:
        task = asyncio.ensure_future(pool.run(ref(LOOP), event(), Limits(5000, 512)))
        victim = await job_worker(pool)   # not the compile worker compiling LOOP first
        os.kill(victim.pid, signal.SIGKILL)
        out = await task
        assert out.error_kind == "crash" and out.status == 500
        assert pool.counters["crashes"] == 1
        # The slot is refilled with a spare at once (no crash back-off).
        await wait_for(lambda: len(pool._idle) == 2)
        assert victim.pid not in pool.worker_pids
        ok = await pool.run(ref(ECHO), event(), LIMITS)
        assert ok.error_kind is None

    run_with_pool(scenario, size=2)


def test_graceful_stop_finishes_running_work_and_ends_processes() -> None:
    pool = Pool(size=2)
    pool.start()
    pids = list(pool.worker_pids)
    zygote = pool._zygote_pid

    async def main() -> None:
        running = asyncio.ensure_future(pool.run(ref(SPIN), event({"s": 0.2}), LIMITS))
        await asyncio.sleep(0.05)
        await pool.stop()
        assert (await running).body == b'{"slept":0.2}'
        with pytest.raises(PoolClosedError):
            await pool.run(ref(ECHO), event(), LIMITS)

    asyncio.run(main())
    assert not any(alive(p) for p in pids + [zygote])
    assert pool.live_workers == 0


def test_start_reports_hardening_and_workers() -> None:
    async def scenario(pool: Pool) -> None:
        assert pool.live_workers == 2
        assert set(pool.hardening) >= {"close_fds", "rlimits", "network_namespace", "drop_user",
                                       "nproc", "no_new_privs", "seccomp", "memguard"}
        assert set(pool.counters) == {"invocations", "timeouts", "memory_kills", "crashes",
                                      "restarts", "queue_depth", "busy_rejections", "queued",
                                      "deprioritised", "quarantined", "retired", "workers",
                                      "guilds", "compiles", "compile_failures", "worker_compiles",
                                      "code_rejected"}

    run_with_pool(scenario)


@pytest.mark.skipif(os.sched_getscheduler(0) != os.SCHED_OTHER,
                    reason="the tests run under another scheduling policy than the default, "
                           "which the workers then keep (see the next test)")
def test_workers_run_under_batch_scheduling_and_the_service_does_not() -> None:
    """A waking worker must not preempt the service mid-turn (docs/performance.md):
    the fork server and every worker (after a job, so after its hardening; also
    the spares forked while the pool serves new guilds) are SCHED_BATCH; the
    service keeps its own policy."""

    async def scenario(pool: Pool) -> None:
        seen: set[int] = set()
        for guild in ("g1", "g2", "g3"):
            ok = await pool.run(ref(ECHO), event(), LIMITS, guild=guild)
            assert ok.error_kind is None
            seen.update(pool.worker_pids)
        assert len(seen) >= 3, "a worker per guild"
        policies = set()
        for pid in [pool._zygote_pid, *seen]:
            try:
                policies.add(os.sched_getscheduler(pid))
            except ProcessLookupError:  # a spare that ended meanwhile
                pass
        assert policies == {os.SCHED_BATCH}
        assert os.sched_getscheduler(0) == os.SCHED_OTHER

    run_with_pool(scenario)


@pytest.mark.timeout(180)
def test_a_service_under_sched_idle_never_gets_workers_above_itself() -> None:
    """SCHED_BATCH beats SCHED_IDLE outright: a service run under SCHED_IDLE
    keeps its fork server and workers under SCHED_IDLE too (a looping script
    would otherwise starve it)."""
    probe = (
        "import asyncio, os\n"
        "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
        "from sandbox.pool import Limits, Pool\n"
        "from tests.sandbox.poolkit import ECHO, event, ref\n"
        # SCHED_IDLE runs only on a core nothing else wants: while other tests
        # keep both cores busy it waits, so its start and job get time to spare.
        "pool = Pool(size=1, spawn_timeout_s=90)\n"
        "pool.start()\n"
        "async def main():\n"
        "    ok = await pool.run(ref(ECHO), event(), Limits(time_ms=60000, memory_kb=512))\n"
        "    assert ok.error_kind is None\n"
        "    pids = [pool._zygote_pid, *pool.worker_pids]\n"
        "    print(sorted({os.sched_getscheduler(pid) for pid in pids}))\n"
        "    await pool.stop()\n"
        "asyncio.run(main())\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=170, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str([os.SCHED_IDLE])


def test_service_signal_handlers_do_not_reach_the_zygote() -> None:
    import signal as sig

    hits: list[int] = []
    old = sig.signal(sig.SIGUSR1, lambda signum, frame: hits.append(signum))
    try:
        pool = Pool(size=1)
        pool.start()
        zygote = pool._zygote_pid
        os.kill(zygote, sig.SIGUSR1)  # default action in the zygote: it ends

        async def main() -> None:
            await wait_for(lambda: not alive(zygote))
            ok = await pool.run(ref(ECHO), event(), LIMITS)  # existing workers still serve
            assert ok.error_kind is None
            await pool.stop()

        asyncio.run(main())
        assert hits == []
    finally:
        sig.signal(sig.SIGUSR1, old)


def test_pool_rebinds_when_its_loop_was_closed() -> None:
    pool = Pool(size=1)
    pool.start()
    try:
        async def first() -> None:
            assert (await pool.run(ref(ECHO), event({"n": 1}), LIMITS)).error_kind is None
            # left running on purpose: its loop closes under it
            asyncio.ensure_future(pool.run(ref(SPIN), event({"s": 0.3}), LIMITS))
            await asyncio.sleep(0.05)

        asyncio.run(first())

        async def second() -> None:
            out = await pool.run(ref(ECHO), event({"n": 2}), LIMITS)
            assert out.body == b'{"ok":true,"double":4}'
            await pool.stop()

        asyncio.run(second())
    finally:
        if pool._state != "stopped":
            asyncio.run(pool.stop())


def test_arguments_are_checked_in_the_service() -> None:
    from dataclasses import FrozenInstanceError

    from sandbox.outcome import failure
    from sandbox.pool import ScriptRef

    with pytest.raises(TypeError):
        ScriptRef("logic_x", "1", "src")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Pool(size=0)
    out = failure("script_timeout", "slow", 1.0)
    assert out.status == 504 and not out.ok
    with pytest.raises(FrozenInstanceError):
        out.status = 200  # type: ignore[misc]
