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
- limits: the request head (line and headers) up to `max_header_bytes` (else
  431), a body backstop of `max_body_bytes` (else 413), the head must arrive
  within `idle_timeout` of the connection's last answer (slow-header clients
  are cut off), the body within `body_timeout`; a client that stops reading
  an answer for `idle_timeout` is cut off too (a send timeout), but a slow
  reader that keeps reading is not;
- an answer sent before the request body was read: the connection is closed
  after it (`Connection: close`) unless the rest of the body is known and
  small; closing is lingering — the write side is shut, what the client still
  sends is read and dropped for up to `linger_seconds` — so the client reads the
  answer instead of a reset;
- malformed requests get 400 and the connection closes (so do HTTP/1.1
  requests without `Host`); versions other than HTTP/1.0 and 1.1 get 505; a
  well-formed request line with a method no registry knows gets 405;
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
import fcntl
import logging
import re
import socket
import struct
import termios
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import httptools  # type: ignore[import-untyped,unused-ignore]
from tornado import httputil

__all__ = ["HTTP1Server", "ServerLimits", "Exchange", "http_date"]

log = logging.getLogger("logic.http")

#: Renders the body of an error the connection itself answers (bad request,
#: head too large...): status -> (headers, body). Set by the service.
ErrorRenderer = Callable[[int], tuple[list[tuple[str, str]], bytes]]

_REASONS = {status.value: status.phrase for status in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_REQUEST_LINE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,32} [\x21-\x7e]+ HTTP/1\.[01]\r?\n")
_LAST_CHUNK = b"0\r\n\r\n"


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Connection limits; see the module docstring for what each one does."""

    max_header_bytes: int = 65536
    max_body_bytes: int = 100 * 1024 * 1024
    idle_timeout: float = 60.0
    body_timeout: float = 30.0
    linger_seconds: float = 2.0
    #: An early answer keeps the connection when at most this much body is left.
    keep_alive_discard: int = 65536
    sweep_interval: float = 1.0


_date: dict[int, str] = {}


def http_date() -> str:
    """The current time as an HTTP `Date` value (formatted once per second)."""
    now = int(time.time())
    text = _date.get(now)
    if text is None:
        _date.clear()
        text = _date[now] = httputil.format_timestamp(now)
    return text


def _plain_error(status: int) -> tuple[list[tuple[str, str]], bytes]:
    return [("Content-Type", "text/plain; charset=utf-8")], _REASONS.get(status, "Error").encode()


class _Context:
    """What `HTTPServerRequest` reads from `connection.context`."""

    __slots__ = ("remote_ip", "protocol", "address")

    def __init__(self, address: Any) -> None:
        self.address = address
        self.remote_ip = address[0] if isinstance(address, tuple) and address else "0.0.0.0"
        self.protocol = "http"


class _ParseAbort(Exception):
    """Raised inside a parser callback to stop parsing with an HTTP status."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class Exchange:
    """One request and its answer: the `HTTPConnection` a delegate writes to.

    Besides Tornado's `write_headers` / `write` / `finish`, `respond()` writes a
    whole answer from a header list in one call (the invoke endpoint's path).
    """

    __slots__ = ("conn", "context", "start_line", "headers", "delegate", "delegate_factory",
                 "keep_alive",
                 "expect_continue", "declared", "received", "request_done", "answered",
                 "answer_started", "chunked_out", "remaining_out", "close_after", "head",
                 "close_callback", "max_body", "body_timeout", "manual_body", "continued",
                 "eof_callback")

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.context = conn.context
        self.start_line: httputil.RequestStartLine | None = None
        #: `HTTPHeaders`, or for delegates with ``plain_headers = True`` a dict
        #: with lower-case names.
        self.headers: httputil.HTTPHeaders | dict[str, str] | None = None
        self.delegate_factory: httputil.HTTPServerConnectionDelegate | None = None
        self.delegate: httputil.HTTPMessageDelegate | None = None
        self.keep_alive = False
        self.expect_continue = False
        self.declared: int | None = None  # Content-Length, when the request has one
        self.received = 0
        self.request_done = False  # the whole request was parsed
        self.answer_started = False
        self.answered = False
        self.chunked_out = False
        self.remaining_out: int | None = None
        self.close_after = False
        #: Called (once) when the client stops sending before this request is
        #: answered: the invoke endpoint takes a request waiting for a sandbox
        #: worker out of the queue (the answer is still written).
        self.eof_callback: Callable[[], None] | None = None
        self.head = False
        self.close_callback: Callable[[], None] | None = None
        self.max_body = conn.limits.max_body_bytes
        self.body_timeout = conn.limits.body_timeout
        self.manual_body = False  # an Upgrade request's body, read without llhttp
        self.continued = False  # "100 Continue" was sent

    # --- tornado.httputil.HTTPConnection ----------------------------------
    def write_headers(self, start_line: httputil.ResponseStartLine | httputil.RequestStartLine,
                      headers: httputil.HTTPHeaders, chunk: bytes | None = None
                      ) -> asyncio.Future[None]:
        assert isinstance(start_line, httputil.ResponseStartLine)
        self._start_answer(start_line.code, start_line.reason, list(headers.get_all()),
                           "Content-Length" in headers, "Transfer-Encoding" in headers,
                           chunk or b"")
        return self.conn.drained()

    def write(self, chunk: bytes) -> asyncio.Future[None]:
        if not self.answer_started:
            raise RuntimeError("write() before write_headers()")
        self._write_body(chunk)
        return self.conn.drained()

    def finish(self) -> None:
        if self.answered:
            return
        if not self.answer_started:
            raise RuntimeError("finish() before write_headers()")
        if self.chunked_out:
            self.conn.write(_LAST_CHUNK)
        self.answered = True
        if self.remaining_out:
            # Fewer bytes than the Content-Length promised: the client would
            # wait for the rest, so the connection cannot be reused.
            log.error("answer shorter than its Content-Length; closing the connection")
            self.close_after = True
        self.conn.answered(self)

    def set_close_callback(self, callback: Callable[[], None] | None) -> None:
        self.close_callback = callback

    def set_max_body_size(self, max_body_size: int) -> None:
        self.max_body = max_body_size

    def set_body_timeout(self, timeout: float) -> None:
        self.body_timeout = timeout
        if self.start_line is not None and not self.request_done:
            self.conn.deadline = self.conn.loop.time() + timeout  # the body's clock

    def detach(self) -> Any:
        raise NotImplementedError("connections cannot be detached")

    # --- the whole answer in one call --------------------------------------
    def respond(self, status: int, headers: Sequence[tuple[str, str]], body: bytes = b"",
                reason: str | None = None) -> list[tuple[str, str]]:
        """Write status, headers and body and finish; returns the headers as
        sent (`Content-Length`, `Connection` and `Date` are the connection's)."""
        if self.answer_started:
            return []
        added = self._start_answer(status, reason, headers, False, False, body, whole=True)
        self.answered = True
        self.conn.answered(self)
        return added

    # --- internals ---------------------------------------------------------
    def _start_answer(self, status: int, reason: str | None, headers: Sequence[tuple[str, str]],
                      has_length: bool, has_te: bool, chunk: bytes, whole: bool = False
                      ) -> list[tuple[str, str]]:
        if self.answer_started:
            raise RuntimeError("the answer was already started")
        conn = self.conn
        start = self.start_line
        version = start.version if start is not None else "HTTP/1.1"
        no_body = self.head or status in (204, 304) or 100 <= status < 200
        lines = [f"HTTP/1.1 {status} {reason or _REASONS.get(status, 'Unknown')}"]
        length: int | None = None
        close = self.close_after
        for name, value in headers:
            lname = name.lower()
            if lname == "connection":
                if value.lower() == "close":
                    close = True
                continue  # the connection's own header is written below
            if lname == "date":
                continue  # always the server's own, written below
            lines.append(f"{name}: {value}")
            if has_length and lname == "content-length":
                length = int(value)
        if whole and not no_body:
            length = len(chunk)
            lines.append(f"Content-Length: {length}")
        elif whole and status not in (204, 304) and not 100 <= status < 200:
            lines.append(f"Content-Length: {len(chunk)}")  # HEAD: the length it would have
        chunked = (not whole and not no_body and not has_length and not has_te
                   and version == "HTTP/1.1")
        if chunked:
            lines.append("Transfer-Encoding: chunked")
        elif not whole and not no_body and not has_length and not has_te:
            close = True  # HTTP/1.0 without a length: the body ends at close
        if not self.request_done:
            left = None if self.declared is None else self.declared - self.received
            if left is None or left > conn.limits.keep_alive_discard:
                close = True
            elif self.expect_continue and not self.continued and left:
                close = True  # the client may never send a body it was not asked for
        if close or conn.closing or not self.keep_alive:
            close = True
            if version == "HTTP/1.1":
                lines.append("Connection: close")
        elif version == "HTTP/1.0":
            lines.append("Connection: keep-alive")
        lines.append("Date: " + http_date())
        head = "\r\n".join(lines)
        if head.count("\n") != len(lines) - 1 or head.count("\r") != len(lines) - 1:
            # Nothing of this answer is written, and nothing else will be: the
            # connection closes after the answers before it, so a client never
            # takes a later answer for this one.
            self.answer_started = self.answered = True
            self.close_after = True
            conn._close_after_answer()
            raise ValueError("Illegal characters (CR or LF) in a header")
        self.answer_started = True
        self.close_after = close
        self.chunked_out = chunked
        self.remaining_out = 0 if no_body else length
        data = head.encode("latin1") + b"\r\n\r\n"
        if chunk and not no_body:
            data += self._frame(chunk)
        conn.write(data)
        return [(name, value) for name, _, value in
                (line.partition(": ") for line in lines[1:])]

    def _frame(self, chunk: bytes) -> bytes:
        if self.remaining_out is not None:
            self.remaining_out -= len(chunk)
            if self.remaining_out < 0:
                raise httputil.HTTPOutputError("Tried to write more data than Content-Length")
        if self.chunked_out:
            return b"%x\r\n%b\r\n" % (len(chunk), chunk)
        return chunk

    def _write_body(self, chunk: bytes) -> None:
        if chunk and not self.head:
            self.conn.write(self._frame(chunk))


class Connection(asyncio.Protocol):
    """One client connection: parses requests and runs their delegates in order."""

    def __init__(self, server: HTTP1Server) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.context = _Context(None)
        self.parser: Any = httptools.HttpRequestParser(self)
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
        self._last_pending = 0  # write buffer at the last sweep
        self._progress = 0.0  # when the write buffer last changed
        self._fd = -1
        self._manual: Exchange | None = None  # an Upgrade request whose body is read by hand
        self._manual_left = 0

    # --- asyncio.Protocol ---------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.context = _Context(transport.get_extra_info("peername"))
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None and hasattr(termios, "TIOCOUTQ") else -1
        self.deadline = self.loop.time() + self.limits.idle_timeout
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.lingering or self._broken:
            return  # dropped: we are closing, or the stream can no longer be parsed
        if self._manual is not None:
            self._feed_manual(data)
            return
        in_head = self._in_head
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            status = cause.status if isinstance(cause, _ParseAbort) else 400
            if not isinstance(cause, _ParseAbort):
                log.error("HTTP parser callback failed", exc_info=cause)
            self._stop_parsing(status)
        except httptools.HttpParserInvalidMethodError:
            # llhttp knows every registered method: a well-formed request line
            # with another token names a method no route serves (405); anything
            # else (TLS on the plain port, binary noise) is a bad request. The
            # request cannot be framed either way: the connection closes.
            unknown = _REQUEST_LINE.match(data) is not None
            self._stop_parsing(405 if unknown else 400)
        except httptools.HttpParserUpgrade as exc:
            # No protocol switch is served: the request is answered normally,
            # then the connection closes.
            if self._manual is not None:
                offset = exc.args[0] if exc.args and isinstance(exc.args[0], int) else len(data)
                self._feed_manual(data[offset:])
            else:
                self._stop_parsing(0)
        except httptools.HttpParserError as exc:
            log.debug("malformed HTTP request from %s: %s", self.context.remote_ip, exc)
            self._stop_parsing(400)
        else:
            if in_head and self._in_head:
                # The whole chunk belongs to a head that is still not complete:
                # httptools keeps an unfinished header line to itself, so the
                # head's size is bounded here.
                self._head_raw += len(data)
                if self._head_raw > self.limits.max_header_bytes:
                    self._stop_parsing(431)

    def eof_received(self) -> bool | None:
        # The client sends nothing more; answers in progress still go out.
        self._eof = True
        active = self._active
        if active is not None and active.eof_callback is not None and not active.answered:
            callback, active.eof_callback = active.eof_callback, None
            callback()
        if self.lingering or self.idle:
            return None  # nothing to answer: let the transport close
        if self._parsing is not None:
            self._stop_parsing(0)  # a request cut off mid-way is never complete
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.parser = None  # it holds this protocol: no cycle left behind
        self.server.connections.discard(self)
        self._queue.clear()
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
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        waiters, self._drain_waiters = self._drain_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    # --- llhttp callbacks (inside feed_data) ----------------------------------
    def on_message_begin(self) -> None:
        if self.lingering or self._broken:
            raise _ParseAbort(0)  # closing: what follows in the buffer is not served
        self._in_head = True
        self._head_raw = 0
        self._parsing = Exchange(self)
        self._url = b""
        self._raw_headers = []
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > self.limits.max_header_bytes:
            raise _ParseAbort(431)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name, value))
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self.limits.max_header_bytes:
            raise _ParseAbort(431)

    def on_headers_complete(self) -> None:
        ex = self._parsing
        assert ex is not None
        self._in_head = False
        parser = self.parser
        method = parser.get_method().decode("latin1")
        version = "HTTP/" + parser.get_http_version()
        target = self._url.decode("latin1")
        ex.delegate_factory = factory = self.server.delegate_for(target)
        headers: httputil.HTTPHeaders | dict[str, str]
        if getattr(factory, "plain_headers", False):
            # Lower-case names, repeated ones joined with ", " (RFC 9110 5.3):
            # what the invoke path needs, at a fraction of HTTPHeaders' cost.
            headers = {}
            for raw_name, raw_value in self._raw_headers:
                name = raw_name.decode("latin1").lower()
                value = raw_value.decode("latin1")
                headers[name] = f"{headers[name]}, {value}" if name in headers else value
        else:
            headers = httputil.HTTPHeaders()
            for raw_name, raw_value in self._raw_headers:
                headers.add(raw_name.decode("latin1"), raw_value.decode("latin1"))
        self._raw_headers = []
        ex.start_line = httputil.RequestStartLine(method, target, version)
        ex.headers = headers
        ex.head = method == "HEAD"
        ex.keep_alive = bool(parser.should_keep_alive())
        if version not in ("HTTP/1.1", "HTTP/1.0"):
            raise _ParseAbort(505)
        if version == "HTTP/1.1" and headers.get("host") is None:
            raise _ParseAbort(400)  # RFC 9112 3.2: a server MUST answer 400
        declared = headers.get("content-length")
        if declared is not None:
            ex.declared = int(declared)  # llhttp checked it is a number
        elif headers.get("transfer-encoding") is None:
            ex.declared = 0  # no body at all (RFC 9112 6.3)
        # llhttp's own flag is set only after this callback: same rule here.
        upgrade = headers.get("upgrade") is not None and "upgrade" in [
            token.strip() for token in headers.get("connection", "").lower().split(",")]
        if upgrade and ex.declared != 0:
            # llhttp leaves the body of an Upgrade request to the new protocol.
            # No protocol switch is served (the connection closes after the
            # answer), so a declared body is read here, by hand; a chunked one
            # cannot be framed without the parser and is refused.
            if ex.declared is None:
                raise _ParseAbort(400)
            ex.manual_body = True
        ex.expect_continue = (version == "HTTP/1.1"
                              and headers.get("expect", "").lower() == "100-continue")
        self.deadline = self.loop.time() + ex.body_timeout
        self._push(self._start, ex, None)
        if ex.declared is not None and ex.declared > ex.max_body:
            # The backstop comes after the handler's own checks (the invoke
            # endpoint answers 404/401/its plan's 413 first); the body is not read.
            raise _ParseAbort(413)
        if ex.expect_continue:
            self._push(self._maybe_continue, ex, None)

    def on_body(self, body: bytes) -> None:
        ex = self._parsing
        assert ex is not None
        self._body_part(ex, body)

    def _body_part(self, ex: Exchange, body: bytes) -> None:
        ex.received += len(body)
        self._push(self._body, ex, body)  # the handler's own cap answers first
        if ex.received > ex.max_body:
            raise _ParseAbort(413)

    def on_message_complete(self) -> None:
        ex = self._parsing
        assert ex is not None
        if ex.manual_body:
            self._manual = ex  # complete once its body was read by hand
            self._manual_left = ex.declared or 0
            return
        self._parsing = None
        self._push(self._complete, ex, None)

    def _feed_manual(self, data: bytes) -> None:
        """The body of an Upgrade request (see on_headers_complete)."""
        ex = self._manual
        assert ex is not None
        part = data[:self._manual_left]
        self._manual_left -= len(part)
        try:
            if part:
                self._body_part(ex, part)
        except _ParseAbort as exc:
            self._manual = None
            self._stop_parsing(exc.status)
            return
        if self._manual_left == 0:
            self._manual = None
            self._parsing = None
            self._push(self._complete, ex, None)
            self._stop_parsing(0)  # what follows belongs to the refused protocol: close

    # --- delivering to delegates, in order, with flow control -------------------
    def _push(self, step: Callable[[Exchange, Any], Awaitable[None] | None], ex: Exchange,
              arg: Any) -> None:
        if self.lingering or self.closed:
            return  # the connection is closing: nothing more is served on it
        if self._blocked or self._queue:
            self._queue.append((step, ex, arg))
            if not self._paused and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()
            return
        self._run(step, ex, arg)

    def _run(self, step: Callable[[Exchange, Any], Awaitable[None] | None], ex: Exchange,
             arg: Any) -> None:
        try:
            waiting = step(ex, arg)
        except httputil.HTTPInputError as exc:
            log.debug("bad request from %s: %s", self.context.remote_ip, exc)
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
        """Run the steps that waited, in order, until one blocks again."""
        self._blocked = False
        while self._queue and not self._blocked and not self.closed:
            step, ex, arg = self._queue.popleft()
            self._run(step, ex, arg)
        if not self._blocked and not self._queue and self._paused and not self.closed \
                and not self.lingering and self.transport is not None:
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
            self.write(_CONTINUE)

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
            self.deadline = self.loop.time() + self.limits.body_timeout

    def _stop_parsing(self, status: int) -> None:
        """The request stream cannot go on: answer `status` (0: none) in turn, then close."""
        self._broken = True
        ex = self._parsing or Exchange(self)
        self._parsing = None
        self._push(self._fail, ex, status)

    def _fail(self, ex: Exchange, status: int) -> None:
        """In turn after every earlier step: answer `status` unless an answer began; close."""
        ex.close_after = True
        if status and not ex.answer_started:
            headers, body = self.server.render_error(status)
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

    def _close_after_answer(self) -> None:
        """Close once written; lingering, so that the client reads the answer."""
        if self.closed or self.lingering or self.transport is None:
            return
        self._queue.clear()
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
        return self._active is None and self._parsing is None and not self._queue

    def _unsent(self) -> int:
        """Bytes of answers not yet read by the client: ours and the kernel's."""
        transport = self.transport
        if transport is None or self.closed:
            return 0
        pending = transport.get_write_buffer_size()
        if self._fd >= 0:
            try:
                # The kernel's send queue: a slow reader drains it long before
                # the socket turns writable again and our buffer moves.
                pending += struct.unpack("i", fcntl.ioctl(self._fd, termios.TIOCOUTQ,
                                                          b"\0\0\0\0"))[0]
            except OSError:
                self._fd = -1
        return pending

    def sweep(self, now: float) -> None:
        """Called about every second: enforce the connection's deadline."""
        transport = self.transport
        pending = self._unsent()
        if pending:
            # An answer is still going out. A slow reader is not an idle
            # client: it has idle_timeout to read on each time it stalls, and
            # the deadlines below start once everything was handed over.
            if pending != self._last_pending:
                self._progress = now
            self._last_pending = pending
            if now - self._progress < self.limits.idle_timeout:
                return
        elif self._last_pending:
            self._last_pending = 0
            wait = self.limits.linger_seconds if self.lingering else self.limits.idle_timeout
            self.deadline = max(self.deadline, now + wait)
        if self.deadline and now > self.deadline:
            ex = self._active
            if ex is not None and ex.request_done and not self.lingering:
                return  # the request is being answered; its handler has the clock
            if not self.lingering:
                log.debug("closing connection from %s: timed out", self.context.remote_ip)
            if transport is not None and transport.get_write_buffer_size():
                self.close_now()  # a client that stopped reading: drop what is buffered
            elif transport is not None and not self.closed:
                # Gracefully: what the kernel still holds of an answer reaches a
                # slow reader before the FIN.
                transport.close()


class HTTP1Server:
    """Serves an `HTTPServerConnectionDelegate` (e.g. a Tornado `Application`)."""

    def __init__(self, delegate: httputil.HTTPServerConnectionDelegate, *,
                 prefixes: Sequence[tuple[str, httputil.HTTPServerConnectionDelegate]] = (),
                 limits: ServerLimits | None = None,
                 render_error: ErrorRenderer | None = None) -> None:
        self.delegate = delegate
        self.prefixes = tuple(prefixes)
        self.limits = limits or ServerLimits()
        self.render_error = render_error or _plain_error
        self.connections: set[Connection] = set()
        self._servers: list[asyncio.AbstractServer] = []
        self._sweeper: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]

    def delegate_for(self, path: str) -> httputil.HTTPServerConnectionDelegate:
        for prefix, delegate in self.prefixes:
            if path.startswith(prefix):
                return delegate
        return self.delegate

    async def add_sockets(self, sockets: Sequence[socket.socket]) -> None:
        """Serve on already bound, listening sockets (see `tornado.netutil.bind_sockets`)."""
        self.loop = asyncio.get_running_loop()
        for sock in sockets:
            server = await self.loop.create_server(lambda: Connection(self), sock=sock,
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
