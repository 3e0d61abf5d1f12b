"""Helpers for the pool tests: a started pool per test and standard events.

Pool tests use real worker processes.  Each test starts its own pool before
its event loop exists (as the service does) and runs its scenario with
``asyncio.run``, so no test depends on an event-loop plugin.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import time
from typing import Any, Awaitable, Callable

from sandbox.channel import WorkerHandle
from sandbox.pool import Limits, Pool, ScriptRef

ECHO = '''import json
on endpoint(event):
    body = event.body
    if not isinstance(body, dict) or not isinstance(body.get("n"), int):
        event.status(422)
        event.reply({"error": "n must be an integer"})
        return
    print("n is", body["n"])
    event.reply({"ok": True, "double": body["n"] * 2})
'''


def event(body: Any = None) -> dict[str, Any]:
    """An invoke event as the service builds it."""
    return {"body": {"n": 21} if body is None else body, "rawBody": "", "headers": {},
            "query": {}, "method": "POST", "ip": "203.0.113.9", "userAgent": "test",
            "timestamp": "2026-11-21T10:00:00.000Z"}


def ref(source: str, key: str | None = None, version: int = 1) -> ScriptRef:
    """A script reference; the key defaults to one derived from the source."""
    if key is None:
        key = "logic_" + hashlib.sha256(source.encode()).hexdigest()[:22]
    return ScriptRef(key=key, version=version, source=source)


LIMITS = Limits(time_ms=1000, memory_kb=512)


def run_with_pool(scenario: Callable[[Pool], Awaitable[Any]], **options: Any) -> Any:
    """Start a pool, run ``scenario(pool)`` in a fresh loop, always stop the pool."""
    options.setdefault("size", 2)
    pool = Pool(**options)
    pool.start()

    async def main() -> Any:
        try:
            return await scenario(pool)
        finally:
            await pool.stop()

    return asyncio.run(main())


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return os.path.exists(f"/proc/{pid}")


async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``predicate`` on the running loop until it holds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


async def settled_workers(pool: Pool, timeout: float = 10.0) -> set[int]:
    """The pool's worker pids once no spare is starting and the set stays the
    same for half a second (a loaded host readies spares late)."""
    deadline = time.monotonic() + timeout
    seen = set(pool.worker_pids)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        now = set(pool.worker_pids)
        if now == seen and pool._unready == 0:
            return now
        seen = now
    raise AssertionError(f"the pool's workers did not settle: {seen}")


async def job_worker(pool: Pool) -> WorkerHandle:
    """The one worker running a job, once it runs it. Not ``pool._busy``: the
    compile worker is busy too while it compiles the job's source for the cache
    (on a slow host, long enough for a test to catch it instead)."""
    found: list[WorkerHandle] = []

    def running() -> bool:
        found[:] = [w for w in pool._workers.values()
                    if w is not None and w.req is not None and w.req.kind == "job"]
        return len(found) == 1

    await wait_for(running)
    return found[0]


def seen_from_outside(pid: int) -> dict[str, Any]:
    """A worker's /proc entries, read by the test process: a hardened worker
    opens no file, its own /proc/<pid>/ included (Landlock). Entries an
    undumpable worker's /proc keeps from a non-root reader are None."""
    base = f"/proc/{pid}"
    seen: dict[str, Any] = {}
    with open(f"{base}/status") as f:
        seen["status"] = {k: v.strip() for k, v in (line.split(":", 1) for line in f
                                                     if ":" in line)}
    with open(f"{base}/stat", "rb") as f:
        seen["stat"] = f.read().rsplit(b")", 1)[1].split()   # [0] is field 3, state
    seen["threads"] = len(os.listdir(f"{base}/task"))
    try:
        fds = sorted(int(x) for x in os.listdir(f"{base}/fd"))
        seen["fds"] = fds
        seen["fd_targets"] = sorted(os.readlink(f"{base}/fd/{x}") for x in fds if x > 3)
        with open(f"{base}/environ", "rb") as f:
            seen["environ_block"] = f.read()
        with open(f"{base}/net/dev") as f:
            seen["interfaces"] = [line.split(":")[0].strip() for line in f.readlines()[2:]]
    except PermissionError:
        seen.update(fds=None, fd_targets=None, environ_block=None, interfaces=None)
    return seen


async def exec_seen(pool: Pool, code: str) -> tuple[bool, Any, dict[str, Any]]:
    """Run unrestricted ``code`` in a hardened worker (the test hook), with
    `seen_from_outside` of that worker read just before: a worker that ran
    the hook is retired after it."""
    pid = pool.worker_pids[0]
    worker = next(w for w in pool._workers.values() if w is not None and w.pid == pid)
    pool._idle.remove(worker)
    pool._idle.append(worker)      # the hook takes the most recently idle worker
    outside = seen_from_outside(pid)
    ok, value = await pool._test_exec(code)
    if ok and isinstance(value, dict) and "pid" in value:
        assert value["pid"] == pid, (value["pid"], pid)
    return ok, value, outside


def stand_in_spin_and_growth(monkeypatch: Any) -> tuple[set[int], set[int]]:
    """(pids that spin, pids that grew past any bound), as housekeeping sees
    them: a worker cannot be made to spin or grow here without taking one
    over, so its CPU clock (the real reading plus a second a look, what a
    spinning one shows) and its resident size are what is stood in for."""
    real_cpu, real_rss = WorkerHandle.cpu_seconds, WorkerHandle.rss
    spinning: set[int] = set()
    growing: set[int] = set()
    looks: dict[int, int] = {}

    def cpu_seconds(self: WorkerHandle) -> float:
        if self.pid not in spinning:
            return real_cpu(self)
        looks[self.pid] = looks.get(self.pid, 0) + 1
        return real_cpu(self) + looks[self.pid]

    def rss(self: WorkerHandle) -> int:
        return 1 << 40 if self.pid in growing else real_rss(self)

    monkeypatch.setattr(WorkerHandle, "cpu_seconds", cpu_seconds)
    monkeypatch.setattr(WorkerHandle, "rss", rss)
    return spinning, growing
