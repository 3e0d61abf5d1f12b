"""Helpers for the pool tests: a started pool per test and standard events.

Pool tests use real worker processes.  Each test starts its own pool before
its event loop exists (as the service does) and runs its scenario with
``asyncio.run``, so no test depends on an event-loop plugin.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any, Awaitable, Callable

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
