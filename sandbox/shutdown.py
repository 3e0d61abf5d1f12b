"""`Shutdown`: the pool's graceful stop, and the test hook that runs code in a worker."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

from sandbox.channel import RequestState
from sandbox.errors import PoolClosedError
from sandbox.outcome import failure
from sandbox.supervisor import Supervisor


class Shutdown(Supervisor):
    """Stopping, for ``Pool`` (which initialises the shared state)."""

    # --- stop ---------------------------------------------------------------
    async def stop(self, timeout: float = 5.0) -> None:
        """Graceful stop: refuse new work, let running jobs end, TERM, wait, KILL."""
        if self._state in ("new", "stopped"):
            self._state = "stopped"
            return
        self._state = "stopping"
        # Only requests still waiting (stale entries' requests run or ran).
        waiting = {id(r): r for until, r in self._timeouts
                   if (r.queued or r.homeless) and r.deadline == until}
        waiting.update((id(r), r) for r in self._homeless.values())
        for req in waiting.values():
            self._sched.cancel(req)
            if not req.future.done():
                req.future.set_exception(PoolClosedError("pool stopped"))
        self._timeouts.clear()
        self._homeless.clear()
        self._queued.clear()
        end = time.monotonic() + timeout
        while self._busy > 0 and time.monotonic() < end:
            await asyncio.sleep(0.005)
        workers = [w for w in self._workers.values() if w is not None]
        for w in workers:
            w.signal(signal.SIGTERM)
        end = time.monotonic() + 1.0
        while time.monotonic() < end and not all(w.exited() for w in workers):
            await asyncio.sleep(0.005)
        for w in workers:
            self._replace(w, failure("crash", "sandbox pool stopped", self._elapsed(w)),
                          backoff=False)
        for handle in (self._tick_handle, self._house_handle):
            if handle is not None:
                handle.cancel()
        if self._loop is not None and self._zygote_alive:
            self._loop.remove_reader(self._ctl.fileno())
        self._ctl.close()  # the zygote kills what is left and exits
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            try:
                done, _ = os.waitpid(self._zygote_pid, os.WNOHANG)
            except ChildProcessError:
                break
            if done:
                break
            await asyncio.sleep(0.005)
        else:
            try:
                os.kill(self._zygote_pid, signal.SIGKILL)
                os.waitpid(self._zygote_pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        self._state = "stopped"

    # --- test hook ------------------------------------------------------------
    async def _test_exec(self, code: str, timeout_ms: int = 5000) -> Any:
        """TEST ONLY: run unrestricted ``code`` in a hardened worker; (ok, result)."""
        if not self._test_hooks:
            raise RuntimeError("test hooks are disabled")
        from sandbox.limits import Limits
        loop = self._loop or self._attach()
        req = RequestState(loop.create_future(), "exec", None, {"code": code},
                           Limits(time_ms=timeout_ms, memory_kb=16))
        while not self._idle:
            await asyncio.sleep(0.005)
        w = self._idle.pop()
        w.guild = "\0test-exec"  # never given to a guild afterwards (it is replaced)
        self._dispatch(w, req)
        return await req.future
