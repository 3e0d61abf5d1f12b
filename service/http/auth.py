"""Endpoint secret checks for the invoke path.

argon2id verification costs tens of milliseconds, so it runs in a thread pool,
at most once per (endpoint, stored hash, presented secret): a positive result
is cached in memory keyed by the stored hash, so a regenerated secret (a new
hash) misses the cache on the very next request on every node. Concurrent
requests presenting the same secret share one verification. Only a SHA-256
digest of the presented secret is kept, and it is compared in constant time.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Executor


_CACHE_SIZE = 10_000


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


class SecretVerifier:
    """Checks presented secrets against stored argon2id hashes, with a positive cache."""

    def __init__(self, verify: Callable[[str, str], bool], executor: Executor) -> None:
        self._verify = verify
        self._executor = executor
        # endpoint id -> (stored hash, digest of the secret that verified against it)
        self._cache: OrderedDict[int, tuple[str, bytes]] = OrderedDict()
        self._inflight: dict[tuple[int, str, bytes], asyncio.Future[bool]] = {}

    def cached(self, endpoint_id: int, stored_hash: str | None, secret: str | None) -> bool:
        """True when this secret already verified against this very hash (no hashing)."""
        if not stored_hash or not secret:
            return False
        hit = self._cache.get(endpoint_id)
        return (hit is not None and hit[0] == stored_hash
                and hmac.compare_digest(hit[1], _digest(secret)))

    async def check(self, endpoint_id: int, stored_hash: str | None, secret: str | None) -> bool:
        """True when `secret` matches the endpoint's stored hash."""
        if not stored_hash or not secret:
            return False
        if self.cached(endpoint_id, stored_hash, secret):
            return True
        digest = _digest(secret)
        key = (endpoint_id, stored_hash, digest)
        pending = self._inflight.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        self._inflight[key] = future
        try:
            ok = await loop.run_in_executor(self._executor, self._verify, stored_hash, secret)
        except Exception as exc:  # pragma: no cover - verify() returns False on mismatch
            future.set_exception(exc)
            future.exception()  # mark retrieved
            raise
        finally:
            self._inflight.pop(key, None)
        future.set_result(ok)
        if ok:
            self._cache[endpoint_id] = (stored_hash, digest)
            self._cache.move_to_end(endpoint_id)
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return ok
