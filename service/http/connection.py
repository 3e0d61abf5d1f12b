"""HTTP/1.1 server connections on asyncio transports and llhttp, under Tornado's interfaces.

Tornado's own `HTTP1Connection` parses and frames in Python on top of
`IOStream`: about 85 µs of CPU per request on the target machine, half of what
a bare Tornado handler costs (docs/performance.md). This module keeps Tornado's
server interfaces — an `HTTPServerConnectionDelegate` starts one
`HTTPMessageDelegate` per request, which answers through an `HTTPConnection` —
so the Tornado `Application` and every `RequestHandler` run on it unchanged,
but it reads and writes through asyncio transports and parses with llhttp
(Node.js's parser, through the `httptools` binding).

What a connection does (the rules Tornado's `HTTP1ServerConnection` had, and
the ones it left to a proxy):

- keep-alive for HTTP/1.1 unless the client sends `Connection: close`; for
  HTTP/1.0 only with `Connection: keep-alive`;
- pipelined requests are answered in order, one at a time; a request's
  delegate is started only when the previous answer is complete;
- flow control: a delegate callback returning an awaitable pauses reading until
  it resolves (`@stream_request_body` handlers rely on it);
- `Expect: 100-continue` is answered once the headers were accepted and the
  body is still wanted (an early answer goes out instead of the 100);
- limits: the request head (line and headers) up to `max_header_bytes` and
  `max_header_lines` (else 431), a body backstop of `max_body_bytes` (else
  413), the head must arrive within `idle_timeout` of the connection's last
  answer and end within `head_timeout` of its first byte (slow-header clients
  are cut off, 408), the body within `body_timeout`; incomplete heads share
  the server's `head_budget_bytes` (the oldest is shed past it, 503); a
  client that stops reading an answer for `idle_timeout` is cut off too (a
  send timeout), but a slow reader that keeps reading is not;
- an answer sent before the request body was read: the connection is closed
  after it (`Connection: close`) unless the rest of the body is known and
  small; closing is lingering — the write side is shut, what the client still
  sends is read and dropped for up to `linger_seconds` — so the client reads the
  answer instead of a reset;
- malformed requests get 400 and the connection closes (so do HTTP/1.1
  requests without `Host`); whitespace after a header's value is not part
  of it (RFC 9112 5); versions other than HTTP/1.0 and 1.1 get 505; a
  well-formed request line with a method no registry knows gets 405 with
  the `Allow` of its path (`HTTP1Server.methods_for`), 404 off every route;
- no protocol switch is served: an `Upgrade` request is answered normally
  and the connection closes; llhttp leaves its body to the new protocol, so a
  `Content-Length` body is read here by hand (a chunked one gets 400);
- the connection's own limits answer after the handler had its say: the
  invoke endpoint's checks (404, 401, its plan's 413) come first;
- a request whose handler has not answered when the connection drops gets
  `on_connection_close()` (once).

Prefix routes send a request whose path starts with a prefix to another
delegate than the default one, before any Tornado routing (the invoke endpoint
uses this to skip `Application` and `RequestHandler`). A delegate that sets
``plain_headers = True`` receives the request headers as a plain dict with
lower-case names (repeated names joined with ", ") instead of `HTTPHeaders`.
A delegate's `Connection: close` header closes the connection after the
answer; the connection writes its own `Connection` header in every case.
"""

from __future__ import annotations

import asyncio
import termios
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from tornado import httputil

from service.http.deadlines import set_buffers, sweep
from service.http.exchange import Exchange
from service.http.wire import CONTINUE, PeerContext, ServerLimits, http_date, log

if TYPE_CHECKING:
    from service.http.listener import HTTP1Server

__all__ = ["Connection", "Exchange", "ServerLimits", "http_date"]


class Connection(asyncio.Protocol):
    """One client connection: parses requests and runs their delegates in order."""

    def __init__(self, server: HTTP1Server) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.context = PeerContext(None)
        self.peer_key = ""  # whose share of the per-address cap (set by the server's admit)
        self.parser: Any = None  # set by service.http.parsing
        self.deadline = 0.0
        self.closing = False  # close after the current answer (server shutting down)
        self.closed = False
        self.lingering = False
        self._parsing: Exchange | None = None  # the request the parser is in
        self._active: Exchange | None = None  # the request whose delegate runs
        self._queue: deque[tuple[Callable[[Exchange, Any], Awaitable[None] | None],
                                 Exchange, Any]] = deque()
        self._blocked = False
        self._awaiting: Exchange | None = None  # answered -> the next request may start
        self._paused = False
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._url = b""
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._broken = False  # parsing stopped (error, upgrade): read nothing more
        self._eof = False  # the client half-closed
        self._eof_sent = False  # our write side is shut
        self._in_head = False  # between the start of a request and the end of its head
        self._head_raw = 0  # bytes received while in one request's head
        self.head_held = 0  # of the server's budget for incomplete heads (listener.hold_head)
        self._last_pending = 0  # unsent bytes at the last sweep
        self._written = 0  # bytes handed to the transport
        self._progress = 0.0  # when the client last took enough of its answers
        self._progress_mark = 0  # bytes it had taken then
        self._progress_need = 0  # bytes it must take from there (deadlines.sweep)
        #: Received bytes not yet parsed: reading stopped for back-pressure
        #: (too many requests queued, or answers not being read).
        self._stash = b""
        self._feeding = False
        self._fd = -1
        self._manual: Exchange | None = None  # an Upgrade request whose body is read by hand
        self._manual_left = 0

    # --- asyncio.Protocol ---------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.context = PeerContext(transport.get_extra_info("peername"))
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None and hasattr(termios, "TIOCOUTQ") else -1
        if sock is not None:
            set_buffers(sock, self.limits.socket_send_buffer, self.limits.socket_receive_buffer)
        self.deadline = self.loop.time() + self.limits.idle_timeout
        transport.set_write_buffer_limits(high=self.limits.write_high_water)  # type: ignore[attr-defined]
        if not self.server.admit(self):
            # Past a connection cap: one polite 503, then close (not lingering:
            # a refused connection gives its descriptor back at once).
            self._broken = True
            headers, body = self.server.render_error(503)
            ex = Exchange(self)
            ex.close_after = True
            self._eof = True  # so the answer's end closes the transport outright
            ex.respond(503, [*headers, ("Retry-After", "1")], body)
            return
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.parser = None  # it holds this protocol: no cycle left behind
        self.server.release(self)
        self._queue.clear()
        self._stash = b""
        for fut in self._drain_waiters:
            if not fut.done():
                fut.set_result(None)
        self._drain_waiters.clear()
        active = self._active
        self._active = None
        if active is not None and not active.answered:
            if active.request_done and active.close_callback is None:
                return  # complete and being answered: the handler finishes on its own
            self._tell_closed(active)

    def pause_writing(self) -> None:
        # Back-pressure: the client does not read its answers as fast as it
        # sends requests. Nothing more is read (so nothing more is answered)
        # until the transport's buffer is below its low-water mark again.
        self._write_paused = True
        self._pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        waiters, self._drain_waiters = self._drain_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
        if not self._blocked:
            self._drain_queue()

    def _pause_reading(self) -> None:
        if not self._paused and not self.lingering and self.transport is not None \
                and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def _feed_stash(self) -> None:
        """Parse what was received while reading was held back (see parsing)."""

    # --- delivering to delegates, in order, with flow control -------------------
    def _push(self, step: Callable[[Exchange, Any], Awaitable[None] | None], ex: Exchange,
              arg: Any) -> None:
        if self.lingering or self.closed:
            return  # the connection is closing: nothing more is served on it
        if self._blocked or self._queue or self._write_paused:
            self._queue.append((step, ex, arg))
            self._pause_reading()
            return
        self._run(step, ex, arg)

    def _run(self, step: Callable[[Exchange, Any], Awaitable[None] | None], ex: Exchange,
             arg: Any) -> None:
        try:
            waiting = step(ex, arg)
        except httputil.HTTPInputError:
            # Its message may quote the request (a header value): not logged.
            self.server.bad_request(self.context.remote_ip, "refused by its handler")
            self._broken = True
            self._fail(ex, 400)
            return
        except Exception:  # noqa: BLE001 - a delegate's bug must not stall the connection
            log.error("HTTP delegate failed", exc_info=True)
            self._broken = True
            self._fail(ex, 500)
            return
        if waiting is not None and not self.closed:
            future = asyncio.ensure_future(waiting)
            if not future.done():
                # Reading pauses only if data for a later step arrives meanwhile
                # (see _push): a client waiting for its answer costs no epoll_ctl.
                self._blocked = True
                future.add_done_callback(self._unblock)
            else:
                self._consume(future)

    @staticmethod
    def _consume(future: asyncio.Future[Any]) -> None:
        # The delegate reports its own errors; a failed flow-control future
        # must not also be reported as "never retrieved".
        if not future.cancelled():
            future.exception()

    def _unblock(self, future: asyncio.Future[Any]) -> None:
        self._consume(future)
        self._resume()

    def _resume(self) -> None:
        """The step that blocked is done: run the ones that waited."""
        self._blocked = False
        self._drain_queue()

    def _drain_queue(self) -> None:
        """Run the steps that waited, in order, until one blocks again or the
        client stops reading its answers; then parse what was held back, and
        read again once nothing waits."""
        while self._queue and not self._blocked and not self._write_paused and not self.closed:
            step, ex, arg = self._queue.popleft()
            self._run(step, ex, arg)
        if self._stash and not self._queue and not self._blocked and not self._write_paused:
            self._feed_stash()
        # Reading goes on while the last step still waits (an answer, a check),
        # as when no step ever queued: data for a later step pauses it again
        # (_push), and an end of input is seen at once (a client that leaves
        # while its request waits for a worker takes it out of the queue).
        if not self._queue and not self._stash and self._paused \
                and not self._write_paused and not self.closed and not self.lingering \
                and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def _start(self, ex: Exchange, _: Any) -> Awaitable[None] | None:
        self._active = ex
        assert ex.start_line is not None and ex.headers is not None
        factory = ex.delegate_factory
        assert factory is not None
        ex.delegate = factory.start_request(self, ex)  # type: ignore[arg-type]
        return ex.delegate.headers_received(ex.start_line, ex.headers)  # type: ignore[arg-type]

    def _maybe_continue(self, ex: Exchange, _: Any) -> None:
        if not ex.answer_started and not ex.request_done and ex.received == 0:
            ex.continued = True
            self.write(CONTINUE)

    def _body(self, ex: Exchange, chunk: bytes) -> Awaitable[None] | None:
        if ex.answered or ex.answer_started:
            return None  # answered early: the rest is read and dropped
        assert ex.delegate is not None
        return ex.delegate.data_received(chunk)

    def _complete(self, ex: Exchange, _: Any) -> Awaitable[None] | None:
        ex.request_done = True
        if not ex.answer_started:
            assert ex.delegate is not None
            ex.delegate.finish()
        if ex.answered:
            self._next(ex)
        else:
            # The next pipelined request waits for this answer (see answered()).
            self._blocked = True
            self._awaiting = ex
        return None

    # --- answers ----------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed and not self._eof_sent:
            self._written += len(data)
            self.transport.write(data)

    def drained(self) -> asyncio.Future[None]:
        """A future that resolves once the transport wants more data."""
        fut = self.loop.create_future()
        if self._write_paused and not self.closed:
            self._drain_waiters.append(fut)
        else:
            fut.set_result(None)
        return fut

    def answered(self, ex: Exchange) -> None:
        """`ex`'s answer is complete."""
        ex.close_callback = None
        if ex.close_after:
            self._close_after_answer()
        elif ex.request_done:
            self._next(ex)
        # else: the rest of a small body is read and dropped, then _complete
        if self._awaiting is ex:
            self._awaiting = None
            self._resume()

    def _next(self, ex: Exchange) -> None:
        """The exchange is over in both directions: ready for the next request."""
        ex.delegate = None  # no reference cycle left for the garbage collector
        if self._active is ex:
            self._active = None
        if ex.close_after or self.closing or self._eof and self.idle:
            self._close_after_answer()
            return
        if self._parsing is None and not self._queue:
            self.deadline = self.loop.time() + self.limits.idle_timeout
        else:
            # The next request began: a head still arriving has head_timeout
            # from now, a body body_timeout.
            wait = self.limits.body_timeout
            if self._in_head:
                wait = min(wait, self.limits.head_timeout)
            self.deadline = self.loop.time() + wait

    def _stop_parsing(self, status: int, extra: tuple[tuple[str, str], ...] = ()) -> None:
        """The stream cannot go on: answer `status` (0: none; + `extra` headers), then close."""
        self._broken = True
        ex = self._parsing or Exchange(self)
        self._parsing = None
        self._push(lambda ex, status: self._fail(ex, status, extra), ex, status)

    def _fail(self, ex: Exchange, status: int, extra: tuple[tuple[str, str], ...] = ()) -> None:
        """In turn after every earlier step: answer `status` unless an answer began; close."""
        ex.close_after = True
        if status and not ex.answer_started:
            headers, body = self.server.render_error(status)
            if status == 503:
                headers = [*headers, ("Retry-After", "1")]
            headers = [*headers, *extra]
            ex.respond(status, headers, body)  # closes once written
        elif ex.answered or not ex.answer_started:
            self._close_after_answer()
        # else an answer is being written: the connection closes when it ends
        if not ex.request_done:
            ex.request_done = True
            self._tell_closed(ex)

    @staticmethod
    def _tell_closed(ex: Exchange) -> None:
        """The request will never complete: tell its handler, once."""
        callback, ex.close_callback = ex.close_callback, None
        delegate, ex.delegate = ex.delegate, None
        if callback is not None:
            callback()  # a RequestHandler's on_connection_close
        elif delegate is not None:
            delegate.on_connection_close()

    def shed_head(self) -> None:
        """Drop the incomplete head, answer 503 `busy` (see parsing)."""

    def _close_after_answer(self) -> None:
        """Close once written; lingering, so that the client reads the answer."""
        if self.closed or self.lingering or self.transport is None:
            return
        self._queue.clear()
        self._stash = b""
        self.lingering = True
        self._broken = True
        transport = self.transport
        if self._eof:
            transport.close()  # the client already finished: close once written
        elif transport.can_write_eof():
            transport.write_eof()  # FIN after the buffered answer
            self._eof_sent = True
            if self._paused:
                self._paused = False
                transport.resume_reading()  # read and drop what the client still sends
            self.deadline = self.loop.time() + self.limits.linger_seconds
        else:
            transport.close()

    def close_now(self) -> None:
        """Drop the connection (timeouts, shutdown of idle connections)."""
        if self.transport is not None and not self.closed:
            self.transport.abort()

    @property
    def idle(self) -> bool:
        return (self._active is None and self._parsing is None and not self._queue
                and not self._stash)

    def sweep(self, now: float) -> None:
        """Called about every second: enforce the connection's deadlines."""
        sweep(self, now)
