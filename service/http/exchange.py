"""`Exchange`: one request and its answer, the `HTTPConnection` a delegate writes to.

It frames the answer (status line, headers, `Content-Length` or chunked,
`Connection`, `Date`) and tells its `Connection` when the answer is complete.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tornado import httputil

from service.http.wire import LAST_CHUNK, REASONS, http_date, log

if TYPE_CHECKING:
    from service.http.connection import Connection


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
                 "eof_callback", "body_kept")

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
        #: Body bytes handed to the handler; past them the rest is read and
        #: dropped (a request without credentials: service.http.app).
        self.body_kept = self.max_body
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
            self.conn.write(LAST_CHUNK)
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
                reason: str | None = None,
                before_send: Callable[[list[tuple[str, str]]], None] | None = None
                ) -> list[tuple[str, str]]:
        """Write status, headers and body and finish; returns the headers as
        sent (`Content-Length`, `Connection` and `Date` are the connection's).
        `before_send` gets them just before the first byte is written."""
        if self.answer_started:
            return []
        if status == 205:
            body = b""  # RFC 9110 15.3.6: Reset Content has no content (Content-Length: 0)
        added = self._start_answer(status, reason, headers, False, False, body, whole=True,
                                   before_send=before_send)
        self.answered = True
        self.conn.answered(self)
        return added

    # --- internals ---------------------------------------------------------
    def _start_answer(self, status: int, reason: str | None, headers: Sequence[tuple[str, str]],
                      has_length: bool, has_te: bool, chunk: bytes, whole: bool = False,
                      before_send: Callable[[list[tuple[str, str]]], None] | None = None
                      ) -> list[tuple[str, str]]:
        if self.answer_started:
            raise RuntimeError("the answer was already started")
        conn = self.conn
        start = self.start_line
        version = start.version if start is not None else "HTTP/1.1"
        no_body = self.head or status in (204, 304) or 100 <= status < 200
        lines = [f"HTTP/1.1 {status} {reason or REASONS.get(status, 'Unknown')}"]
        sent: list[tuple[str, str]] = []  # the headers as sent, for `before_send`
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
            sent.append((name, value))
            if has_length and lname == "content-length":
                length = int(value)
        if whole and not no_body:
            length = len(chunk)
            lines.append(f"Content-Length: {length}")
            sent.append(("Content-Length", str(length)))
        elif whole and status not in (204, 304) and not 100 <= status < 200:
            lines.append(f"Content-Length: {len(chunk)}")  # HEAD: the length it would have
            sent.append(("Content-Length", str(len(chunk))))
        chunked = (not whole and not no_body and not has_length and not has_te
                   and version == "HTTP/1.1")
        if chunked:
            lines.append("Transfer-Encoding: chunked")
            sent.append(("Transfer-Encoding", "chunked"))
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
                sent.append(("Connection", "close"))
        elif version == "HTTP/1.0":
            lines.append("Connection: keep-alive")
            sent.append(("Connection", "keep-alive"))
        date = http_date()
        lines.append("Date: " + date)
        sent.append(("Date", date))
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
        if before_send is not None:
            before_send(sent)
        conn.write(data)
        return sent

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

