"""`HTTP1Server`: accepts connections on listening sockets and sweeps their deadlines."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Sequence

from tornado import httputil

from service.http.connection import Connection
from service.http.parsing import ParsingConnection
from service.http.wire import ErrorRenderer, ServerLimits, log, plain_error

__all__ = ["HTTP1Server", "ServerLimits"]

#: Seconds between two log lines about malformed requests.
BAD_REQUEST_LOG_INTERVAL = 10.0


class HTTP1Server:
    """Serves an `HTTPServerConnectionDelegate` (e.g. a Tornado `Application`)."""

    def __init__(self, delegate: httputil.HTTPServerConnectionDelegate, *,
                 prefixes: Sequence[tuple[str, httputil.HTTPServerConnectionDelegate]] = (),
                 limits: ServerLimits | None = None,
                 render_error: ErrorRenderer | None = None) -> None:
        self.delegate = delegate
        self.prefixes = tuple(prefixes)
        self.limits = limits or ServerLimits()
        self.render_error = render_error or plain_error
        self.connections: set[Connection] = set()
        self._servers: list[asyncio.AbstractServer] = []
        self._sweeper: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._bad = 0  # malformed requests since the last log line about them
        self._bad_logged = -BAD_REQUEST_LOG_INTERVAL

    def bad_request(self, ip: str, reason: str) -> None:
        """A malformed request was refused: one INFO line per interval at most,
        with a count, an address and a fixed reason, never the request's content."""
        self._bad += 1
        now = time.monotonic()
        if now - self._bad_logged >= BAD_REQUEST_LOG_INTERVAL:
            log.info("refused %d malformed request(s) in %.0f s; latest from %s: %s",
                     self._bad, min(now - self._bad_logged, BAD_REQUEST_LOG_INTERVAL), ip,
                     reason)
            self._bad = 0
            self._bad_logged = now

    def delegate_for(self, path: str) -> httputil.HTTPServerConnectionDelegate:
        for prefix, delegate in self.prefixes:
            if path.startswith(prefix):
                return delegate
        return self.delegate

    async def add_sockets(self, sockets: Sequence[socket.socket]) -> None:
        """Serve on already bound, listening sockets (see `tornado.netutil.bind_sockets`)."""
        self.loop = asyncio.get_running_loop()
        for sock in sockets:
            server = await self.loop.create_server(lambda: ParsingConnection(self), sock=sock,
                                                   backlog=1024)
            self._servers.append(server)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(self.limits.sweep_interval, self._sweep)

    def _sweep(self) -> None:
        now = self.loop.time()
        for conn in list(self.connections):
            conn.sweep(now)
        self._sweeper = self.loop.call_later(self.limits.sweep_interval, self._sweep)

    def stop(self) -> None:
        """Stop accepting connections; open ones stay until `close_all_connections`."""
        for server in self._servers:
            server.close()
        self._servers = []

    async def close_all_connections(self, timeout: float = 5.0) -> None:
        """Close idle connections now, busy ones after their answer; wait until all are gone."""
        for conn in list(self.connections):
            conn.closing = True
            if conn.idle:
                conn.close_now()
        deadline = self.loop.time() + timeout
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            conn.close_now()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
