"""`AppContext`: the running service's parts, handed to every handler by `initialize()`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from service.auth import SecretVerifier
from service.ratelimit import RateLimits
from service.records import RecordWriter

if TYPE_CHECKING:
    from sandbox.pool import Pool
    from service.core.invoke_target import InvokeTarget
    from service.settings import Settings


@dataclass
class AppContext:
    """What handlers need, built once by `service.server` and never global."""

    settings: Settings
    pool: Pool
    limits: RateLimits
    verifier: SecretVerifier
    records: RecordWriter
    load_target: Callable[[str, str], InvokeTarget | None]
    db_ping: Callable[[], bool]
    in_flight: int = 0
    draining: bool = False
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

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
