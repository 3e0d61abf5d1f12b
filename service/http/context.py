"""`AppContext`: the running service's parts, handed to every handler by `initialize()`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from service.http.auth import SecretVerifier
from service.http.metrics import Metrics
from service.http.metrics_export import Exporter
from service.http.parse_ledger import HeldBodies, ParseLedger
from service.http.ratelimit import RateLimits
from service.http.records import RecordWriter

if TYPE_CHECKING:
    from models.change_feed import ChangeFeed
    from sandbox.pool import Pool
    from service.core.invoke_target import InvokeTarget, TargetCache
    from service.settings import Settings


class RecentTargets:
    """Endpoint lookups remembered for `ttl` seconds: only for throttled callers.

    An address that sent more than 20 wrong secrets in a minute is answered
    429 whatever it sends; checks 2-4 still come first for it, but from a
    lookup at most `ttl` old instead of a database query per request when the
    `TargetCache` cannot answer from memory (PostgreSQL while its change feed
    cannot vouch, or without one).
    """

    def __init__(self, ttl: float = 1.0, max_entries: int = 10_000) -> None:
        self._ttl = ttl
        self._max = max_entries
        self._entries: dict[tuple[str, str], tuple[float, InvokeTarget | None]] = {}

    def get(self, guild_id: str, script_id: str) -> tuple[bool, InvokeTarget | None]:
        """(True, the answer) when one at most `ttl` old is remembered, else (False, None)."""
        found = self._entries.get((guild_id, script_id))
        if found is not None and time.monotonic() - found[0] < self._ttl:
            return True, found[1]
        return False, None

    def put(self, guild_id: str, script_id: str, target: InvokeTarget | None) -> None:
        if len(self._entries) >= self._max:
            self._entries.clear()
        self._entries[(guild_id, script_id)] = (time.monotonic(), target)


@dataclass
class AppContext:
    """What handlers need, built once by `service.http.server` and never global."""

    settings: Settings
    pool: Pool
    limits: RateLimits
    verifier: SecretVerifier
    records: RecordWriter
    #: The endpoint lookup: call it, or `lookup()`/`fetch()` on the hot path.
    load_target: TargetCache
    db_ping: Callable[[], bool]
    recent_targets: RecentTargets = field(default_factory=RecentTargets)
    #: What decoding each guild's large bodies cost the loop (its 503s' refunds).
    parse_ledger: ParseLedger = field(default_factory=ParseLedger)
    #: Each guild's requests with a large body decoded and not yet finished.
    held_bodies: HeldBodies = field(default_factory=HeldBodies)
    #: PostgreSQL only: the process's LISTEN connection (endpoint changes, revoked tokens).
    change_feed: ChangeFeed | None = None
    in_flight: int = 0
    draining: bool = False
    _idle: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: set[asyncio.Future[Any]] = field(default_factory=set)
    #: Plain counters the invoke path and the handlers add to (service.http.metrics).
    metrics: Metrics = field(default_factory=Metrics)
    #: Formats `GET /metrics`; the multiprocess files when PROMETHEUS_MULTIPROC_DIR is set.
    metrics_export: Exporter = field(init=False)

    def __post_init__(self) -> None:
        self.metrics.per_guild = self.settings.metrics.per_guild
        self.metrics_export = Exporter.from_environment(self)

    def background(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run `work` on the loop without waiting for it (kept referenced until done)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def request_started(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def request_ended(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.in_flight = 0
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if `timeout` passed first."""
        if self.in_flight == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True
