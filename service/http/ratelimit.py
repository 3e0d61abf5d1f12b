"""Sliding-window limits: requests per endpoint and failed secrets per IP.

Both are exact moving windows of 60 s: "how many in the last 60 s" and "when
does a slot free" have exact answers. `[ratelimit] storage` picks where the
windows live:

- ``memory://`` (one node): a deque of timestamps per key, owned by the event
  loop thread. Amortised O(1) per request, no locks, no threads.
- ``redis://host:6379/0`` (several nodes sharing limits): the same windows in
  Redis (`service.http.redis_windows`), awaited: never a blocking call on the
  event loop. `remote` is then True and callers use the ``a``-prefixed
  coroutines (``ahit_endpoint``...); the plain methods serve memory:// without
  a future or a task per request.

While Redis is unreachable, `on_storage_error` decides: ``"open"`` (the
default) admits requests under this process's own memory windows (each node
then enforces the limits by itself, and the wrong-secret throttle stays on);
``"closed"`` refuses every request that needs a limit with 503 `busy`
(`LimitsUnavailable`). Either way one warning per outage, and the shared
windows are used again as soon as Redis answers.

Why not the `limits` library (used before): its memory storage cost about a
fifth of the service's CPU per request on the invoke path (two locked calls
per request, an O(n) list insert, and a timer thread started every 10 ms to
expire entries), for what a deque does in a few lines; its Redis storage is
synchronous, and its asynchronous one needs two round trips per decision
where one Lua call does.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.http.memory_windows import WINDOW_S, MemoryWindows, Stamp
from service.http.wire import peer_group

if TYPE_CHECKING:
    from service.http.redis_windows import RedisWindows

#: DESIGN section 4: more than this many wrong secrets from one IP in 60 s are throttled.
AUTH_FAILURES_PER_MINUTE = 20
#: `ratelimit.on_storage_error` values.
ON_STORAGE_ERROR = ("open", "closed")


class LimitsUnavailable(Exception):
    """The shared storage is unreachable and `on_storage_error` is "closed" (answer 503 busy)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """The state of an endpoint's window after (or without) counting a request."""

    allowed: bool
    limit: int
    remaining: int
    reset_seconds: int  # whole seconds until the oldest counted request leaves the window
    #: The counted hit's own mark (`Stamp`), to give back exactly that hit
    #: (`refund_endpoint`); None when nothing was counted.
    stamp: Stamp = None

    def headers(self) -> dict[str, str]:
        return {
            "RateLimit-Limit": str(self.limit),
            "RateLimit-Remaining": str(self.remaining),
            "RateLimit-Reset": str(self.reset_seconds),
        }


class _Gate:
    """The credentials of one address being checked now, the requests looking at
    its count or waiting, and how many checks have ended wrong (to spot a
    failure counted while a request's look at the shared count was on its way)."""

    __slots__ = ("checking", "looking", "settled", "waiters")

    def __init__(self) -> None:
        self.checking = 0
        self.looking = 0
        self.settled = 0
        self.waiters: list[asyncio.Future[None]] = []

    @property
    def idle(self) -> bool:
        return self.checking <= 0 and self.looking <= 0 and not self.waiters


#: Requests of one address that may wait for its running checks; past it, 429.
AUTH_WAITERS_PER_ADDRESS = 256


class RateLimits:
    """Per-endpoint request quotas and per-IP failed-secret throttling."""

    def __init__(self, storage_uri: str = "memory://",
                 clock: Callable[[], float] = time.time, ipv6_prefix: int = 64, *,
                 on_storage_error: str = "open", storage_timeout_s: float = 1.0,
                 windows: MemoryWindows | None = None, installation: str = "") -> None:
        """`windows`: memory windows to use instead of this process's own (the
        front processes' shared ones, `service.http.shared_windows`);
        `installation`: the id Redis keys are named after."""
        if on_storage_error not in ON_STORAGE_ERROR:
            raise ValueError(f"on_storage_error must be one of {ON_STORAGE_ERROR}")
        self._clock = clock
        self._ipv6_prefix = ipv6_prefix
        # memory://: the windows; a shared storage: the fallback while it is down
        # (shared by the node's front processes either way).
        self._windows = windows if windows is not None else MemoryWindows(clock)
        self._remote: RedisWindows | None = None
        self._open = on_storage_error == "open"
        if not storage_uri.startswith("memory://"):
            from service.http.redis_windows import RedisWindows
            self._remote = RedisWindows(storage_uri, window_s=WINDOW_S,
                                        timeout_s=storage_timeout_s, clock=clock,
                                        installation=installation)
        #: True when the windows are shared (Redis): use the ``a``-prefixed coroutines.
        self.remote = self._remote is not None
        #: Addresses with credentials being checked now (`auth_admit`), this process.
        self._gates: dict[str, _Gate] = {}

    def _reset(self, count: int, oldest: float) -> int:
        if count == 0:
            return 0
        return max(0, math.ceil(oldest + WINDOW_S - self._clock()))

    def hit_endpoint(self, endpoint_id: int, per_minute: int) -> Decision:
        """Count one authenticated request against the endpoint's quota, if a slot is free."""
        allowed, count, oldest, stamp = self._windows.hit(f"ep:{endpoint_id}", per_minute)
        reset = self._reset(count, oldest)
        if not allowed:
            reset = max(1, reset)  # a slot frees within this second: never say 0
        return Decision(allowed, per_minute, max(0, per_minute - count), reset, stamp)

    def refund_endpoint(self, endpoint_id: int, per_minute: int, stamp: Stamp) -> None:
        """Give back the slot a request took (`Decision.stamp`: it was answered 503 busy)."""
        self._windows.refund(f"ep:{endpoint_id}", per_minute, stamp)

    def peek_endpoint(self, endpoint_id: int, per_minute: int) -> Decision:
        """The endpoint's window without counting a request."""
        count, oldest = self._windows.peek(f"ep:{endpoint_id}", per_minute)
        return Decision(True, per_minute, max(0, per_minute - count), self._reset(count, oldest))

    def hit_key(self, key: str, per_minute: int) -> Decision:
        """Count one request under any other key (e.g. the admin API's per-token
        limit, ``api:<token id>``), if a slot is free."""
        allowed, count, oldest, stamp = self._windows.hit(key, per_minute)
        reset = self._reset(count, oldest)
        if not allowed:
            reset = max(1, reset)
        return Decision(allowed, per_minute, max(0, per_minute - count), reset, stamp)

    # --- a shared storage: the same decisions, awaited ---------------------------
    async def _ahit(self, key: str, limit: int) -> tuple[bool, int, float, Stamp]:
        if self._remote is not None:
            got = await self._remote.hit(key, limit)
            if got is not None:
                return got
            if not self._open:
                raise LimitsUnavailable()
        return self._windows.hit(key, limit)

    async def _apeek(self, key: str, limit: int) -> tuple[int, float]:
        if self._remote is not None:
            got = await self._remote.peek(key, limit)
            if got is not None:
                return got
            if not self._open:
                raise LimitsUnavailable()
        return self._windows.peek(key, limit)

    async def ahit_endpoint(self, endpoint_id: int, per_minute: int) -> Decision:
        """`hit_endpoint` on any storage.  Raises `LimitsUnavailable`."""
        allowed, count, oldest, stamp = await self._ahit(f"ep:{endpoint_id}", per_minute)
        reset = self._reset(count, oldest)
        if not allowed:
            reset = max(1, reset)
        return Decision(allowed, per_minute, max(0, per_minute - count), reset, stamp)

    async def apeek_endpoint(self, endpoint_id: int, per_minute: int) -> Decision:
        """`peek_endpoint` on any storage.  Raises `LimitsUnavailable`."""
        count, oldest = await self._apeek(f"ep:{endpoint_id}", per_minute)
        return Decision(True, per_minute, max(0, per_minute - count), self._reset(count, oldest))

    async def arefund_endpoint(self, endpoint_id: int, per_minute: int, stamp: Stamp) -> None:
        """`refund_endpoint` on any storage: where the hit was counted (Redis: a
        stored entry; the fallback window while Redis was down: a time)."""
        if isinstance(stamp, str):
            if self._remote is not None:
                await self._remote.refund(f"ep:{endpoint_id}", per_minute, stamp)
        else:
            self._windows.refund(f"ep:{endpoint_id}", per_minute, stamp)

    async def ahit_key(self, key: str, per_minute: int) -> Decision:
        """`hit_key` on any storage.  Raises `LimitsUnavailable`."""
        allowed, count, oldest, stamp = await self._ahit(key, per_minute)
        reset = self._reset(count, oldest)
        if not allowed:
            reset = max(1, reset)
        return Decision(allowed, per_minute, max(0, per_minute - count), reset, stamp)

    async def aauth_throttled(self, ip: str) -> int:
        """`auth_throttled` on any storage.  Raises `LimitsUnavailable`."""
        count, oldest = await self._apeek(f"auth:{self.auth_key(ip)}", AUTH_FAILURES_PER_MINUTE)
        if count < AUTH_FAILURES_PER_MINUTE:
            return 0
        return max(1, self._reset(count, oldest))

    async def auth_admit(self, ip: str) -> int:
        """A turn to check a credential presented from `ip` the costly way: 0 once
        it may be checked (then call `auth_settle`, always), else the seconds the
        address must wait (nothing taken).

        The failures counted for the address and the credentials of it being
        checked now in this process together stay within the allowance: past it
        a request waits while any of those checks run (each may prove right and
        count nothing, and then lets the longest-waiting request in; at most
        `AUTH_WAITERS_PER_ADDRESS` wait) and is refused once the failures alone
        reach the allowance or no check is left. So wrong credentials sent all
        at once get no more checks than sent one after another, and a client's
        own burst of right ones waits a moment instead of being refused. A look
        at a shared count (Redis) during which a check ended wrong is repeated:
        its failure may have been counted after the look was answered.
        Raises `LimitsUnavailable`.
        """
        key = self.auth_key(ip)
        gate = self._gates.get(key)
        if gate is None:
            gate = self._gates[key] = _Gate()
        gate.looking += 1
        try:
            while True:
                settled = gate.settled
                count, oldest = await self._apeek(f"auth:{key}", AUTH_FAILURES_PER_MINUTE)
                if gate.settled != settled:
                    continue          # a failure was counted meanwhile: it may be missing
                if count + gate.checking < AUTH_FAILURES_PER_MINUTE:
                    gate.checking += 1
                    return 0
                if (gate.checking == 0 or count >= AUTH_FAILURES_PER_MINUTE
                        or len(gate.waiters) >= AUTH_WAITERS_PER_ADDRESS):
                    return max(1, self._reset(count, oldest))
                waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                gate.waiters.append(waiter)
                try:
                    await waiter      # a check of this address ended: look again
                finally:
                    if waiter in gate.waiters:
                        gate.waiters.remove(waiter)
        finally:
            gate.looking -= 1
            if gate.idle and self._gates.get(key) is gate:
                del self._gates[key]

    async def auth_settle(self, ip: str, failed: bool) -> None:
        """End the turn `auth_admit` gave: count the credential if it was wrong,
        then wake who may go on (never raises). A right credential frees its turn:
        the longest-waiting request looks again; a wrong one's turn became a
        failure: nobody can go on, until no check is left and every waiting
        request looks again (to be refused, or let in by a window that slid)."""
        key = self.auth_key(ip)
        try:
            if failed:
                await self.aauth_failed(ip)
        finally:
            gate = self._gates.get(key)
            if gate is not None:
                gate.checking -= 1
                if failed:
                    gate.settled += 1   # a look on its way may lack this failure
                if gate.checking <= 0:
                    waking, gate.waiters = gate.waiters, []
                elif not failed and gate.waiters:
                    waking = [gate.waiters.pop(0)]
                else:
                    waking = []
                for waiter in waking:
                    if not waiter.done():
                        waiter.set_result(None)
                if gate.idle:
                    del self._gates[key]

    async def aauth_failed(self, ip: str) -> None:
        """`auth_failed` on any storage (never raises: an uncounted failure is the lesser harm)."""
        try:
            await self._ahit(f"auth:{self.auth_key(ip)}", AUTH_FAILURES_PER_MINUTE)
        except LimitsUnavailable:
            pass

    async def probe_storage(self) -> None:
        """Ask the shared storage whether it answers (memory://: nothing to ask),
        so `storage_state` is now's, not the last request's."""
        if self._remote is not None:
            await self._remote.ping()

    def storage_state(self) -> dict[str, Any]:
        """For /readyz: which storage, and whether it answers."""
        remote = self._remote
        if remote is None:
            return {"state": "up", "storage": "memory"}
        state: dict[str, Any] = {"state": "up" if remote.down_since is None else "down",
                                 "storage": "redis",
                                 "onError": "open" if self._open else "closed"}
        if remote.down_since is not None:
            state["downForSeconds"] = round(time.monotonic() - remote.down_since, 1)
            state["error"] = remote.last_error
        return state

    async def close(self) -> None:
        """Close the shared storage's connections (memory://: nothing)."""
        if self._remote is not None:
            await self._remote.close()

    def auth_key(self, ip: str) -> str:
        """Whose failures `ip`'s count with: an IPv4 address itself, an IPv6
        address its network of `ipv6_prefix` bits (`service.http.wire.peer_group`,
        which keys the per-address connection cap too)."""
        return peer_group(ip, self._ipv6_prefix)

    def auth_throttled(self, ip: str) -> int:
        """Seconds the IP must wait before its secrets are checked again; 0 if not throttled."""
        count, oldest = self._windows.peek(f"auth:{self.auth_key(ip)}", AUTH_FAILURES_PER_MINUTE)
        if count < AUTH_FAILURES_PER_MINUTE:
            return 0
        return max(1, self._reset(count, oldest))

    def auth_failed(self, ip: str) -> None:
        """Record one wrong secret presented from `ip`."""
        self._windows.hit(f"auth:{self.auth_key(ip)}", AUTH_FAILURES_PER_MINUTE)
