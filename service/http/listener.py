"""`HTTP1Server`: accepts connections on listening sockets, caps them, sweeps their deadlines.

Connection caps: at most `max_connections` in all and `max_connections_per_ip`
from one peer address, an IPv6 peer counting with its network of `ipv6_prefix`
bits (`wire.peer_group`, as the wrong-secret throttle: one subscriber's /64
is one address here); addresses in `cap_exempt`, e.g. the trusted reverse
proxy, are counted only in the total; past either, the connection gets one
503 `busy` with `Retry-After` and is closed. `max_connections = 0` derives the
cap from the descriptor limit (raised to its hard limit first) minus a
reserve, so the sandbox pool can always open the pipes and sockets of a
worker it respawns. What connections pin in memory together (unsent
answers, input held back) has a budget, checked at every sweep: past it
connections are cut, stalled ones first. After a storm of connections closes, or
once much of what they pinned is freed, memory is handed back to the OS
(`malloc_trim`, glibc).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import heapq
import ipaddress
import resource
import socket
import time
from collections.abc import Callable, Sequence

from tornado import httputil

from service.http.connection import Connection
from service.http.deadlines import drop, pinned
from service.http.parsing import ParsingConnection
from service.http.turns import Turns
from service.http.wire import ErrorRenderer, ServerLimits, log, peer_group, plain_error

__all__ = ["HTTP1Server", "ServerLimits"]

#: Seconds between two log lines about malformed requests.
BAD_REQUEST_LOG_INTERVAL = 10.0
#: Connections at once that count as a storm (memory is handed back after one).
STORM = 1000
#: Bytes pinned by connections at once after whose release memory is handed
#: back too (a few hundred slow readers held ~400 MB that stayed: review, session 29).
TRIM_BYTES = 64 * 1024 * 1024
#: At most one hand-back in this many seconds.
TRIM_INTERVAL_S = 10.0


def derived_connection_cap(reserve: int) -> int:
    """The descriptor limit (soft raised to hard where allowed) minus `reserve`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        soft = 1_048_576
    return max(16, soft - reserve)


def release_memory() -> None:
    """Return free heap pages to the OS (glibc's malloc_trim; elsewhere nothing)."""
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


class HTTP1Server:
    """Serves an `HTTPServerConnectionDelegate` (e.g. a Tornado `Application`)."""

    def __init__(self, delegate: httputil.HTTPServerConnectionDelegate, *,
                 prefixes: Sequence[tuple[str, httputil.HTTPServerConnectionDelegate]] = (),
                 limits: ServerLimits | None = None,
                 render_error: ErrorRenderer | None = None, max_connections: int = 0,
                 max_connections_per_ip: int = 256, fd_reserve: int = 256,
                 cap_exempt: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network] = (),
                 ipv6_prefix: int = 64,
                 methods_for: Callable[[str], Sequence[str] | None] | None = None) -> None:
        self.delegate = delegate
        #: The methods a request target's route answers (None: no route serves
        #: it), for the answer to a method token nothing knows; unset: 405 alone.
        self.methods_for = methods_for or (lambda target: ())
        self.max_connections = max_connections or derived_connection_cap(fd_reserve)
        self.max_connections_per_ip = max_connections_per_ip
        self.ipv6_prefix = ipv6_prefix
        self.cap_exempt = tuple(cap_exempt)
        self._per_ip: dict[str, int] = {}
        self._admitted: set[Connection] = set()
        #: Bytes held by incomplete heads (`hold_head`), and their connections, oldest first.
        self.head_bytes = 0
        self._heads: dict[Connection, None] = {}
        self._peak = 0  # most connections since memory was last handed back
        self._pinned_peak = 0  # most bytes pinned by connections since then
        self._trimmed_at = float("-inf")
        self._over_budget = False  # cutting connections for the buffer budget
        self.prefixes = tuple(prefixes)
        self.limits = limits or ServerLimits()
        self.render_error = render_error or plain_error
        self.connections: set[Connection] = set()
        self._servers: list[asyncio.AbstractServer] = []
        self._sweeper: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self.turns: Turns = None  # type: ignore[assignment]  # set by add_sockets
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

    def admit(self, conn: Connection) -> bool:
        """Count a new connection in; False (not counted) past a cap."""
        ip = conn.context.remote_ip
        key = conn.peer_key = peer_group(ip, self.ipv6_prefix)
        per_ip = self._per_ip.get(key, 0)
        if len(self._admitted) >= self.max_connections or (
                per_ip >= self.max_connections_per_ip and not self._exempt(ip)):
            self.bad_request(ip, "connection refused: connection cap reached")
            return False
        self._per_ip[key] = per_ip + 1
        self._admitted.add(conn)
        self._peak = max(self._peak, len(self._admitted))
        return True

    def release(self, conn: Connection) -> None:
        """A connection closed."""
        self.connections.discard(conn)
        if conn.head_held:
            self.hold_head(conn, 0)
        if conn in self._admitted:
            self._admitted.discard(conn)
            key = conn.peer_key
            left = self._per_ip.get(key, 1) - 1
            if left > 0:
                self._per_ip[key] = left
            else:
                self._per_ip.pop(key, None)

    def hold_head(self, conn: Connection, held: int) -> None:
        """`conn`'s incomplete head now holds about `held` bytes (0: it ended or
        went). Past `limits.head_budget_bytes` in all, the oldest incomplete
        heads are shed (503 `busy`, close) until the rest fit. A head that
        arrives whole is never counted, so what goes is what waited longest:
        a slow or hostile client (without a budget, 14,920 heads of ~60 KB
        took a server from 76 to 1,088 MB)."""
        self.head_bytes += held - conn.head_held
        conn.head_held = held
        if not held:
            self._heads.pop(conn, None)
            return
        self._heads.setdefault(conn, None)
        while self.head_bytes > self.limits.head_budget_bytes and self._heads:
            oldest = next(iter(self._heads))
            self.hold_head(oldest, 0)
            self.bad_request(oldest.context.remote_ip,
                             "incomplete head shed: incomplete heads over their memory budget")
            oldest.shed_head()

    def trusted_proxy(self, ip: str) -> bool:
        """Whether `ip` is in `cap_exempt` (the trusted reverse proxies)."""
        return self._exempt(ip)

    def _exempt(self, ip: str) -> bool:
        if not self.cap_exempt:
            return False
        try:
            address = ipaddress.ip_address(ip)
        except ValueError:
            return False
        return any(address in net for net in self.cap_exempt)

    def delegate_for(self, path: str) -> httputil.HTTPServerConnectionDelegate:
        for prefix, delegate in self.prefixes:
            if path.startswith(prefix):
                return delegate
        return self.delegate

    async def add_sockets(self, sockets: Sequence[socket.socket]) -> None:
        """Serve on already bound, listening sockets (see `tornado.netutil.bind_sockets`)."""
        self.loop = asyncio.get_running_loop()
        self.turns = Turns(self.loop, self.limits.requests_per_turn)
        for sock in sockets:
            server = await self.loop.create_server(lambda: ParsingConnection(self), sock=sock,
                                                   backlog=1024)
            self._servers.append(server)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(self.limits.sweep_interval, self._sweep)

    def _sweep(self) -> None:
        now = self.loop.time()
        held = 0
        for conn in list(self.connections):
            conn.sweep(now)
            held += pinned(conn)
        budget = self.limits.buffer_budget_bytes
        if budget and held > budget:
            held = self._shed(held, budget, now)
        elif self._over_budget and held < budget // 2:
            self._over_budget = False
        self._pinned_peak = max(self._pinned_peak, held)
        storm = self._peak >= STORM and len(self._admitted) < self._peak // 4
        freed = self._pinned_peak >= TRIM_BYTES and held < self._pinned_peak // 4
        if (storm or freed) and now - self._trimmed_at >= TRIM_INTERVAL_S:
            # A storm of connections, or of what they held, is over: give the
            # freed memory back.
            self._peak, self._pinned_peak, self._trimmed_at = len(self._admitted), held, now
            gc.collect()
            release_memory()
        self._sweeper = self.loop.call_later(self.limits.sweep_interval, self._sweep)

    def _shed(self, held: int, budget: int, now: float) -> int:
        """Cut connections until what is left is under 3/4 of `budget`: first
        those whose clients took nothing of their answers lately, largest
        first (a client downloading a large answer at its pace is not cut for
        another's stalled connections: review, session 29); then the others
        from the address group pinning the most, largest first, the groups
        ranked again after each cut (connections of one address reading just
        enough to count as taking their answers were cut after an innocent
        client's one large answer: review, session 30); returns what is left."""
        recent = 2 * self.limits.sweep_interval
        target = budget * 3 // 4
        stalled: list[tuple[int, Connection]] = []
        moving: dict[str, list[tuple[int, Connection]]] = {}
        for conn in self.connections:
            size = pinned(conn)
            if size == 0:
                continue
            transport = conn.transport
            if (now - conn._progress < recent or transport is None
                    or not transport.get_write_buffer_size()):
                # Taking its answers lately, or holding only input the server
                # itself held back (its turn, a full queue): not the client's
                # stall (a review, session 30: a paused upload was cut first).
                moving.setdefault(conn.peer_key, []).append((size, conn))
            else:
                stalled.append((size, conn))
        cut = 0
        for size, conn in sorted(stalled, key=lambda pair: -pair[0]):
            if held <= target:
                break
            drop(conn)
            held -= size
            cut += 1
        groups: list[tuple[int, str, list[tuple[int, Connection]]]] = []
        for key, members in moving.items():
            members.sort(key=lambda pair: pair[0])   # the largest last, popped first
            groups.append((-sum(size for size, _ in members), key, members))
        heapq.heapify(groups)
        while held > target and groups:
            total, key, members = heapq.heappop(groups)
            size, conn = members.pop()
            drop(conn)
            held -= size
            cut += 1
            if members:
                heapq.heappush(groups, (total + size, key, members))
        if not self._over_budget:
            self._over_budget = True   # one line per episode, not per sweep
            log.warning("connections pinned more than server.buffer_budget_bytes (%d MiB) of "
                        "unsent answers and unread input: %d were cut, those whose clients took "
                        "none of their answers lately first, then from the address pinning the "
                        "most", budget >> 20, cut)
        return held

    def stop(self) -> None:
        """Stop accepting connections; open ones stay until `close_all_connections`,
        except those of a trusted proxy (`cap_exempt`): closed now when idle,
        after their answer when busy.

        A proxy sends a request that finds its connection closed to another
        node (docs/deployment.md, nginx's `proxy_next_upstream`), where it is
        answered; left open, the connection would carry requests into the
        drain, each refused 503. A direct client keeps its connection and
        gets that 503 with `Retry-After`.
        """
        for server in self._servers:
            server.close()
        self._servers = []
        for conn in list(self.connections):
            if self._exempt(conn.context.remote_ip):
                conn.closing = True
                if conn.idle:
                    conn.close_now()

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
