"""Worker-level races and misbehaviour: late replies, bad frames, dying at start."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from sandbox.channel import WorkerHandle
from sandbox.pool import Limits, Pool

from tests.sandbox.poolkit import ECHO, alive, event, ref, run_with_pool, wait_for

pytestmark = pytest.mark.timeout(60)

LATE = '''import time
on endpoint(event):
    start = time.monotonic()
    while time.monotonic() - start < 0.4:
        pass
    event.reply("late")
'''


def test_late_reply_after_timeout_is_never_read_as_the_next_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A real SIGKILL makes a late reply impossible; to reach the race, the
    # kill is suppressed so the timed-out worker lives on and replies late.
    spared: list[int] = []
    real_signal = WorkerHandle.signal

    def no_kill(self: WorkerHandle, signum: int) -> None:
        if signum == signal.SIGKILL and self.req is not None:
            spared.append(self.pid)
            return
        real_signal(self, signum)

    monkeypatch.setattr(WorkerHandle, "signal", no_kill)

    async def scenario(pool: Pool) -> None:
        out = await pool.run(ref(LATE), event(), Limits(time_ms=100, memory_kb=512))
        assert out.error_kind == "script_timeout"
        assert spared and alive(spared[0])
        # The next requests go to a fresh worker; the spared one finishes its
        # loop and writes "late" into a channel nobody reads any more.
        for i in range(5):
            nxt = await pool.run(ref(ECHO), event({"n": i}), Limits(1000, 512))
            assert nxt.body == b'{"ok":true,"double":%d}' % (2 * i)
            await asyncio.sleep(0.1)
        assert pool.counters["crashes"] == 0
        await wait_for(lambda: not alive(spared[0]), timeout=3)  # EPIPE ended it

    try:
        run_with_pool(scenario, size=1)
    finally:
        for pid in spared:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_invalid_frame_from_worker_kills_it_and_answers_crash() -> None:
    async def scenario(pool: Pool) -> None:
        before = pool.worker_pids[0]
        out = await pool._test_exec("import os\nos.write(3, b'\\x00\\x00\\x00\\x04\\xc1\\xc1\\xc1\\xc1')\n"
                                    "import time\nwhile True: pass")
        assert getattr(out, "error_kind", None) == "crash"
        await wait_for(lambda: pool.live_workers == 1)
        assert pool.worker_pids[0] != before and not alive(before)
        ok = await pool.run(ref(ECHO), event(), Limits(1000, 512))
        assert ok.error_kind is None

    run_with_pool(scenario, size=1, _unsafe_test_hooks=True)


def test_oversized_frame_from_worker_is_refused() -> None:
    async def scenario(pool: Pool) -> None:
        out = await pool._test_exec("import os\nos.write(3, (64 << 20).to_bytes(4, 'big'))\n"
                                    "while True: pass")
        assert getattr(out, "error_kind", None) == "crash"

    run_with_pool(scenario, size=1, _unsafe_test_hooks=True)


def test_ready_worker_dying_young_is_replaced_without_back_off() -> None:
    # A worker that was ready ran (or could run) a script: its death is the
    # script's doing, answered by quarantine (test_tenancy.py), never by a
    # slot back-off that would empty the pool. Only a worker that dies
    # before it is ready counts towards the back-off.
    async def scenario(pool: Pool) -> None:
        pool.attach()
        victim = pool.worker_pids[0]
        os.kill(victim, signal.SIGKILL)
        await wait_for(lambda: pool.live_workers == 1 and pool.worker_pids[0] != victim)
        assert not pool._failures.get(0), pool._failures
        ok = await pool.run(ref(ECHO), event(), Limits(1000, 512))
        assert ok.error_kind is None

    run_with_pool(scenario, size=1)


def test_start_fails_fast_when_the_fork_server_cannot_start(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    import time

    from sandbox import zygote
    from sandbox.errors import SpawnError

    def broken() -> None:
        raise ImportError("no language runtime")

    monkeypatch.setattr(zygote, "warm", broken)  # inherited by the forked zygote
    pool = Pool(size=1, fresh_interpreter=False)  # a patch only a forked zygote inherits
    t0 = time.monotonic()
    with pytest.raises(SpawnError):
        pool.start()
    assert time.monotonic() - t0 < 3
    assert "no language runtime" in capfd.readouterr().err


def test_quiet_worker_at_start_is_killed_and_start_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from sandbox import hardening
    from sandbox.errors import SpawnError

    def hang(*args: object, **kwargs: object) -> None:
        time.sleep(60)

    monkeypatch.setattr(hardening, "harden", hang)  # inherited by zygote and workers
    pool = Pool(size=1, spawn_timeout_s=0.5, fresh_interpreter=False)
    t0 = time.monotonic()
    with pytest.raises(SpawnError):
        pool.start()
    assert time.monotonic() - t0 < 2.5
    zygote = pool._zygote_pid
    assert not alive(zygote)


def test_idle_worker_past_the_rss_bound_is_recycled() -> None:
    async def scenario(pool: Pool) -> None:
        first = pool.worker_pids[0]
        pool.attach()
        await wait_for(lambda: pool.worker_pids and pool.worker_pids[0] != first, timeout=4)
        await wait_for(lambda: pool.live_workers == 1)
        assert pool.counters["restarts"] >= 1
        ok = await pool.run(ref(ECHO), event(), Limits(1000, 512))
        assert ok.error_kind is None

    run_with_pool(scenario, size=1, max_rss_mb=1)
