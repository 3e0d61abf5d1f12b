"""Endpoint secret checks for the invoke path.

A stored keyed verifier under this process's key (every secret made or used
since it exists, see `service.core.secrets`) is checked inline by `check()`,
in constant time: about a microsecond, no queue, no thread. Anything else (a
bare argon2id hash, a verifier under another key) costs an argon2id
verification of tens of milliseconds, so it runs in a thread pool, at most
once per (endpoint, stored hash, presented secret). For both, a positive
result is cached in memory keyed by the stored hash, so a regenerated secret
(a new hash) misses the cache on the very next request on every node.
Concurrent requests presenting the same secret share one verification. Only
a SHA-256 digest of the presented secret is kept in memory, and it is
compared in constant time. After a successful slow verification `upgrade`
(if given) rewrites the stored hash with a verifier under this process's
key, in the thread pool, so the next start has nothing slow left to verify
for that endpoint.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from concurrent.futures import Executor

from service.core.secrets import LEGACY_PREFIX, is_fast, verify_fast
from service.http.ratelimit import RateLimits

log = logging.getLogger("logic.http")


_CACHE_SIZE = 10_000
#: Seconds a hash rewrite waits for the loop to remember the new hash before writing it.
UPGRADE_REMEMBER_S = 1.0


def presented_secret(headers: Mapping[str, str]) -> str | None:
    """The secret a request presents, from `Authorization: Bearer` or `X-Service-Secret`.

    `headers`: Tornado's `HTTPHeaders` or a dict with lower-case names.
    """
    auth = headers.get("authorization")
    if auth:
        scheme, _, token = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    secret = headers.get("x-service-secret")
    if secret and secret.strip():
        return secret.strip()
    return None


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


class VerifierBusy(Exception):
    """The verification queue (or the endpoint's share of it) is full: nothing was hashed."""


class Throttled(Exception):
    """The address is past its wrong-secret allowance: nothing was checked."""

    def __init__(self, wait: int) -> None:
        super().__init__(wait)
        self.wait = wait


class SecretVerifier:
    """Checks presented secrets against stored argon2id hashes, with a positive cache.

    Verifications wait in one queue per endpoint and are started in turn
    across endpoints (round robin), at most `workers` at a time: a flood of
    secrets for one endpoint delays another endpoint's first valid secret by
    at most one verification per worker. At most `max_pending` wait in all and
    `per_endpoint` per endpoint; past that `check()` raises `VerifierBusy`
    before any hashing.
    """

    def __init__(self, verify: Callable[[str, str], bool], executor: Executor, *,
                 workers: int = 2, max_pending: int = 64, per_endpoint: int = 8,
                 upgrade: Callable[[int, str, str, Callable[[str], None]], object] | None = None,
                 ) -> None:
        self._verify = verify
        self._upgrade = upgrade
        self._executor = executor
        self._workers = max(1, workers)
        self._max_pending = max_pending
        self._per_endpoint = per_endpoint
        # endpoint id -> (stored hash, digest of the secret that verified against it)
        self._cache: OrderedDict[int, tuple[str, bytes]] = OrderedDict()
        self._inflight: dict[tuple[int, str, bytes], asyncio.Future[bool]] = {}
        #: endpoint id -> verifications waiting, in the order endpoints take turns
        self._queues: OrderedDict[int, deque[_Job]] = OrderedDict()
        self._pending = 0  # waiting, not yet started
        self._running = 0

    @property
    def pending(self) -> int:
        """Verifications waiting for a worker."""
        return self._pending

    def cached(self, endpoint_id: int, stored_hash: str | None, secret: str | None) -> bool:
        """True when this secret already verified against this very hash (no hashing)."""
        if not stored_hash or not secret:
            return False
        hit = self._cache.get(endpoint_id)
        return (hit is not None and hit[0] == stored_hash
                and hmac.compare_digest(hit[1], _digest(secret)))

    async def check(self, endpoint_id: int, stored_hash: str | None, secret: str | None) -> bool:
        """True when `secret` matches the endpoint's stored hash; `VerifierBusy` when full."""
        if not stored_hash or not secret:
            return False
        if self.cached(endpoint_id, stored_hash, secret):
            return True
        digest = _digest(secret)
        if is_fast(stored_hash):
            # Checked inline (about a microsecond): no queue, no thread.
            ok = verify_fast(stored_hash, secret)
            if ok:
                self._remember(endpoint_id, stored_hash, digest)
                if stored_hash.startswith(LEGACY_PREFIX):
                    # An unkeyed digest at rest: rewritten (argon2id made once).
                    self._start_upgrade(endpoint_id, stored_hash, secret, digest)
            return ok
        key = (endpoint_id, stored_hash, digest)
        pending = self._inflight.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        queue = self._queues.get(endpoint_id)
        if self._pending >= self._max_pending or (
                queue is not None and len(queue) >= self._per_endpoint):
            raise VerifierBusy()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        self._inflight[key] = future
        if queue is None:
            queue = self._queues[endpoint_id] = deque()
        queue.append(_Job(key, stored_hash, secret, future))
        self._pending += 1
        self._dispatch(loop)
        try:
            ok = await asyncio.shield(future)
        finally:
            self._inflight.pop(key, None)
        if ok:
            self._remember(endpoint_id, stored_hash, digest)
            self._start_upgrade(endpoint_id, stored_hash, secret, digest)
        return ok

    def _start_upgrade(self, endpoint_id: int, stored_hash: str, secret: str,
                       digest: bytes) -> None:
        if self._upgrade is None:
            return
        loop = asyncio.get_running_loop()

        def remember_first(rewritten: str) -> None:
            """(On the upgrade's thread, before the row is written.) What the row
            will hold verified too: remembered before any lookup can read it, so
            an address throttled for wrong secrets still gets this right one
            answered at once."""
            remembered = threading.Event()

            def remember() -> None:
                if self._cache.get(endpoint_id) == (stored_hash, digest):
                    self._remember(endpoint_id, rewritten, digest)
                remembered.set()

            try:
                loop.call_soon_threadsafe(remember)
            except RuntimeError:
                return   # the loop is closed: the server stops
            remembered.wait(UPGRADE_REMEMBER_S)

        upgrading = loop.run_in_executor(self._executor, self._upgrade, endpoint_id, stored_hash,
                                         secret, remember_first)
        upgrading.add_done_callback(_log_upgrade_failure)

    def _remember(self, endpoint_id: int, stored_hash: str, digest: bytes) -> None:
        self._cache[endpoint_id] = (stored_hash, digest)
        self._cache.move_to_end(endpoint_id)
        if len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)

    def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start waiting verifications, one endpoint's turn after another."""
        while self._running < self._workers and self._queues:
            endpoint_id, queue = next(iter(self._queues.items()))
            job = queue.popleft()
            if queue:
                self._queues.move_to_end(endpoint_id)  # the next endpoint's turn
            else:
                del self._queues[endpoint_id]
            self._pending -= 1
            self._running += 1
            done = loop.run_in_executor(self._executor, self._verify, job.stored_hash, job.secret)
            done.add_done_callback(functools.partial(self._finished, loop, job))

    def _finished(self, loop: asyncio.AbstractEventLoop, job: _Job,
                  done: asyncio.Future[bool]) -> None:
        self._running -= 1
        if not job.future.done():
            if done.cancelled():
                job.future.cancel()
            elif done.exception() is not None:
                job.future.set_exception(done.exception())  # type: ignore[arg-type]
            else:
                job.future.set_result(done.result())
        self._dispatch(loop)


async def counted_check(verifier: SecretVerifier, limits: RateLimits, ip: str, endpoint_id: int,
                        stored_hash: str | None, secret: str | None) -> bool:
    """`verifier.check` in a turn of `ip`'s wrong-secret allowance (`auth_admit`):
    a wrong secret is counted against the address, a right one costs nothing.
    Raises `Throttled` (nothing was checked), `VerifierBusy`, `LimitsUnavailable`."""
    if secret is None:
        return False
    wait = await limits.auth_admit(ip)
    if wait:
        raise Throttled(wait)
    failed = False
    try:
        ok = await verifier.check(endpoint_id, stored_hash, secret)
        failed = not ok
        return ok
    finally:
        await limits.auth_settle(ip, failed)


def _log_upgrade_failure(done: "asyncio.Future[object]") -> None:
    if not done.cancelled() and done.exception() is not None:
        log.warning("could not rewrite a secret hash with a keyed verifier: %s",
                    type(done.exception()).__name__)


class _Job:
    __slots__ = ("key", "stored_hash", "secret", "future")

    def __init__(self, key: tuple[int, str, bytes], stored_hash: str, secret: str,
                 future: asyncio.Future[bool]) -> None:
        self.key = key
        self.stored_hash = stored_hash
        self.secret = secret
        self.future = future
