"""`RedisWindows`: the moving windows of `service.http.ratelimit` in a shared Redis, awaited.

One round trip per decision: a Lua script counts the window, adds the hit if
a slot is free and says how old the oldest counted hit is, all on Redis's own
clock (`TIME`), so nodes whose clocks disagree still share one exact window.
The window is a list, newest first, trimmed to the limit: the layout (and key
names) of the `limits` library's moving window, which earlier versions used.

Nothing here blocks the event loop: `redis.asyncio` on a bounded connection
pool, every call bounded by `timeout_s`. When Redis cannot be reached (refused,
reset, timed out), a call returns None and the windows count as *down*: one
warning, then no call at all for `retry_s`, after which one request probes
again; the first call that starts after the outage was noticed and succeeds
ends it (one info line). What the limiter does meanwhile is
`ratelimit.on_storage_error` (`service.http.ratelimit.RateLimits`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("logic.ratelimit")

#: Connections to Redis per process: requests beyond this wait for one (bounded by the timeout).
MAX_CONNECTIONS = 32
#: Seconds between probes while Redis is down.
RETRY_S = 1.0

# KEYS[1]: the window (a list of hit times, newest first).
# ARGV: limit, window seconds, 1 to count a hit if a slot is free (0: only look).
# Returns {allowed (0/1), hits in the window, age in seconds of the oldest (string),
#          the entry pushed for this hit ('' when none)}.
_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local limit = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local edge = now - window
local len = math.min(redis.call('LLEN', KEYS[1]), limit)
local lo, hi, count = 0, len - 1, 0
while lo <= hi do
  local mid = math.floor((lo + hi) / 2)
  if tonumber(redis.call('LINDEX', KEYS[1], mid)) > edge then
    count = mid + 1
    lo = mid + 1
  else
    hi = mid - 1
  end
end
local allowed = 0
local entry = ''
if ARGV[3] == '1' and count < limit then
  entry = string.format('%.6f', now)
  redis.call('LPUSH', KEYS[1], entry)
  redis.call('LTRIM', KEYS[1], 0, limit - 1)
  redis.call('EXPIRE', KEYS[1], math.ceil(window))
  count = count + 1
  allowed = 1
end
local age = '0'
if count > 0 then
  age = string.format('%.6f', now - tonumber(redis.call('LINDEX', KEYS[1], count - 1)))
end
return {allowed, count, age, entry}
"""


def _key(namespace: str, key: str, limit: int) -> str:
    # The `limits` library's key for a per-minute item in the namespace.
    return f"LIMITS:LIMITER/{namespace}/{key}/{limit}/1/minute"


class RedisWindows:
    """Moving windows in Redis; every method is a coroutine and returns None while Redis is down."""

    def __init__(self, url: str, *, window_s: float, timeout_s: float, retry_s: float = RETRY_S,
                 clock: Any = time.time, installation: str = "") -> None:
        """`installation`: the id every key is named after (`models.installation`),
        so installations sharing one Redis server keep apart."""
        self._namespace = f"logic-{installation}" if installation else "logic"
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError

        self._pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=MAX_CONNECTIONS, timeout=timeout_s,
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            # One immediate retry on a broken connection (Redis restarted since
            # it was pooled); a timeout is not retried: it already took long.
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        self._client = aioredis.Redis(connection_pool=self._pool)
        self._script = self._client.register_script(_SCRIPT)
        self._window_s = window_s
        self._retry_s = retry_s
        self._clock = clock
        self._retry_at = 0.0
        #: `time.monotonic()` when the current outage was noticed; None while Redis answers.
        self.down_since: float | None = None
        #: The kind of the error that started the current outage (never its text: it may hold a host).
        self.last_error = ""
        self.outages = 0

    async def _run(self, key: str, limit: int, hit: bool) -> Any:
        return await self._attempt(lambda: self._script(
            keys=[_key(self._namespace, key, limit)], args=[limit, self._window_s, 1 if hit else 0]))

    async def ping(self) -> None:
        """Ask Redis whether it answers (for /readyz), as any call would: a node
        that started while Redis was down said it was ready until a request
        first tried it (review, session 25). During an outage at most once per
        `retry_s`, like the requests' own probe."""
        await self._attempt(self._client.ping)

    async def _attempt(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """`call()`'s reply, or None while Redis is down (its failure noted)."""
        started = time.monotonic()
        if self.down_since is not None:
            if started < self._retry_at:
                return None
            self._retry_at = started + self._retry_s  # this call probes; the others do not wait
        try:
            reply = await call()
        except Exception as err:  # noqa: BLE001 - refused, reset, timed out, or a broken pool
            self._failed(err)
            return None
        # Only a call that started after the outage was noticed proves it over.
        if self.down_since is not None and started > self.down_since:
            self._recovered()
        return reply

    def _failed(self, err: BaseException) -> None:
        now = time.monotonic()
        self._retry_at = now + self._retry_s
        if self.down_since is None:
            self.down_since = now
            self.last_error = type(err).__name__
            self.outages += 1
            log.warning("rate-limit storage unreachable (%s); see ratelimit.on_storage_error "
                        "for what requests get until it is back", self.last_error)

    def _recovered(self) -> None:
        assert self.down_since is not None
        log.warning("rate-limit storage reachable again after %.1f s; shared limits apply again",
                    time.monotonic() - self.down_since)
        self.down_since = None
        self.last_error = ""

    async def hit(self, key: str, limit: int) -> tuple[bool, int, float, str | None] | None:
        """Count a hit if a slot is free: (allowed, hits in window, oldest hit
        time, the entry stored for the hit or None), or None."""
        reply = await self._run(key, limit, True)
        if reply is None:
            return None
        allowed, count, age, entry = reply
        if isinstance(entry, bytes):
            entry = entry.decode("ascii")
        return bool(allowed), int(count), self._clock() - float(age), entry or None

    async def peek(self, key: str, limit: int) -> tuple[int, float] | None:
        """(hits in window, oldest hit time) without counting, or None."""
        reply = await self._run(key, limit, False)
        if reply is None:
            return None
        _, count, age, _ = reply
        return int(count), self._clock() - float(age)

    async def refund(self, key: str, limit: int, entry: str) -> None:
        """Take back the hit `hit` stored as `entry` (not the newest: see
        `memory_windows.MemoryWindows.refund`; nothing while Redis is down)."""
        if self.down_since is not None:
            return
        try:
            await self._client.lrem(_key(self._namespace, key, limit), 1, entry)
        except Exception as err:  # noqa: BLE001
            self._failed(err)

    async def close(self) -> None:
        await self._client.aclose()
        await self._pool.aclose()
