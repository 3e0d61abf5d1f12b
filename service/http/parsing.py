"""`ParsingConnection`: a `Connection` fed by llhttp (through `httptools`).

It owns the parser callbacks: the request head is collected and checked
(size, version, `Host`, framing), an `Exchange` is made per request and its
steps (start, body parts, completion) are handed to the connection's ordered
delivery (`service.http.connection`).
"""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING

import httptools  # type: ignore[import-untyped,unused-ignore]
from tornado import httputil

from service.http.exchange import Exchange
from service.http.feeding import FREE_HEADER_LINES, QUEUED_BODY_BYTES, REQUESTS_PER_TURN, Feeding

__all__ = ["ParsingConnection", "QUEUED_BODY_BYTES", "REQUESTS_PER_TURN", "content_length"]
from service.http.wire import REQUEST_LINE, ParseAbort, log

if TYPE_CHECKING:
    from service.http.listener import HTTP1Server

#: Whitespace around a header's tokens (RFC 9110 5.6.3: space and tab only;
#: `str.strip()` would also take Latin-1's NBSP and NEL, which llhttp keeps).
_OWS = " \t"



def content_length(value: str) -> int:
    """A Content-Length llhttp accepted (1*DIGIT, below 2**64) as a number.

    Leading zeros are allowed (RFC 9110 8.6) and may be many: ``int()`` refuses
    a string of more than 4,300 digits, which made a 400 with a logged
    traceback of each such request (review, session 25)."""
    return int(value.lstrip("0") or "0")

class ParsingConnection(Feeding):
    """A client connection whose bytes are parsed by llhttp (fed as `Feeding` says)."""

    def __init__(self, server: HTTP1Server) -> None:
        super().__init__(server)
        self.parser = httptools.HttpRequestParser(self)

    def _feed_slice(self, data: bytes) -> None:
        in_head = self._in_head
        begun = self._begun
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            status = cause.status if isinstance(cause, ParseAbort) else 400
            if not isinstance(cause, ParseAbort):
                # A bug of ours: where it happened, but not the exception's
                # message (it may quote the request).
                log.error("HTTP parser callback failed (%s):\n%s", type(cause).__name__,
                          "".join(traceback.format_tb(cause.__traceback__ if cause else None)))
            self._stop_parsing(status)
        except httptools.HttpParserInvalidMethodError:
            # llhttp knows every registered method: a well-formed request line
            # with another token names a method no route serves (405, `Allow`:
            # what its path has; 404 for a path nothing serves, as a known
            # method there); anything else (TLS on the plain port, binary
            # noise) is a bad request. The request cannot be framed either
            # way: the connection closes.
            line = REQUEST_LINE.match(data)
            if line is None:
                self._stop_parsing(400)
            else:
                allowed = self.server.methods_for(line.group(1).decode("ascii"))
                if allowed is None:
                    self._stop_parsing(404)
                else:
                    self._stop_parsing(405, (("Allow", ", ".join(allowed)),) if allowed else ())
        except httptools.HttpParserUpgrade as exc:
            # No protocol switch is served: the request is answered normally,
            # then the connection closes.
            if self._manual is not None:
                offset = exc.args[0] if exc.args and isinstance(exc.args[0], int) else len(data)
                self._feed_manual(data[offset:])
            else:
                self._stop_parsing(0)
        except httptools.HttpParserError as exc:
            self.server.bad_request(self.context.remote_ip, "malformed request")
            # A version llhttp does not know (HTTP/1.2, HTTP/3.0): 505, not 400.
            self._stop_parsing(505 if str(exc) == "Invalid HTTP version" else 400)
        else:
            if in_head and self._in_head and self._begun == begun:
                # The whole slice belongs to a head that is still not complete:
                # httptools keeps an unfinished header line to itself, so the
                # head's size is bounded here. (A head that began inside this
                # slice is counted from the next one, and by on_url/on_header.)
                self._head_raw += len(data)
                if self._head_raw > self.limits.max_header_bytes:
                    self._stop_parsing(431)
                    return
            if self._in_head:
                # A head still incomplete holds memory (the parser's pieces,
                # the headers so far) until it ends: counted against the
                # server's budget, as the whole slice when the head began in
                # it (an upper bound).
                same = in_head and self._begun == begun
                self.server.hold_head(self, self.head_held + len(data) if same else len(data))
            elif self.head_held:
                self.server.hold_head(self, 0)

    def shed_head(self) -> None:
        """The server sheds this connection's incomplete head (incomplete heads
        are over their memory budget): what the parser holds goes now, the
        client gets 503 `busy` in turn, then the connection closes."""
        self._raw_headers = []
        self._url = b""
        self.parser = None
        self._stop_parsing(503)

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


    # --- llhttp callbacks (inside feed_data) ----------------------------------
    def on_message_begin(self) -> None:
        if self.lingering or self._broken:
            raise ParseAbort(0)  # closing: what follows in the buffer is not served
        self._in_head = True
        self._head_raw = 0
        self._begun += 1
        self._parts = 0
        # Once begun, a head has head_timeout to end (the idle deadline may be later).
        deadline = self.loop.time() + self.limits.head_timeout
        if not self.deadline or deadline < self.deadline:
            self.deadline = deadline
        self._parsing = Exchange(self)
        self._url = b""
        self._raw_headers = []
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > self.limits.max_header_bytes:
            raise ParseAbort(431)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name, value))
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self.limits.max_header_bytes:
            raise ParseAbort(431)
        if len(self._raw_headers) > self.limits.max_header_lines:
            # A count as well as a size: 64 KB of tiny headers is ~9,000 of
            # them, each a Python object and, on the application's routes,
            # an HTTPHeaders.add (~62 ms of CPU for one such head).
            raise ParseAbort(431)

    def on_headers_complete(self) -> None:
        ex = self._parsing
        assert ex is not None
        self._in_head = False
        parser = self.parser
        method = parser.get_method().decode("latin1")
        version = "HTTP/" + parser.get_http_version()
        target = self._url.decode("latin1")
        if target[:1] != "/" and target[:8].lower().startswith(("http://", "https://")):
            # Absolute form (RFC 9112 3.2.2: a server MUST accept it): routed
            # and handed on by its path and query, like the origin form.
            rest = target.partition("://")[2]
            cut = len(rest.split("/", 1)[0].split("?", 1)[0])  # the authority's end
            target = rest[cut:] if rest[cut:cut + 1] == "/" else "/" + rest[cut:]
        ex.delegate_factory = factory = self.server.delegate_for(target)
        headers: httputil.HTTPHeaders | dict[str, str]
        if getattr(factory, "plain_headers", False):
            # Lower-case names, repeated ones joined with ", " (RFC 9110 5.3):
            # what the invoke path needs, at a fraction of HTTPHeaders' cost.
            # Whitespace after a value is not part of it (RFC 9112 5); llhttp
            # keeps it.
            headers = {}
            repeated: dict[str, list[str]] | None = None
            for raw_name, raw_value in self._raw_headers:
                name = raw_name.decode("latin1").lower()
                value = raw_value.rstrip(b" \t").decode("latin1")
                if name not in headers:
                    headers[name] = value
                elif repeated is None:
                    repeated = {name: [headers[name], value]}
                elif name in repeated:
                    repeated[name].append(value)
                else:
                    repeated[name] = [headers[name], value]
            if repeated:
                # Joined once: joining at every repeat made a head of one name
                # repeated thousands of times quadratic.
                for name, values in repeated.items():
                    headers[name] = ", ".join(values)
        else:
            headers = httputil.HTTPHeaders()
            try:
                for raw_name, raw_value in self._raw_headers:
                    headers.add(raw_name.decode("latin1"), raw_value.rstrip(b" \t").decode("latin1"))
            except httputil.HTTPInputError:
                # Tornado refuses some values llhttp lets through (e.g. one
                # ending in a control character): the client's error, never a
                # traceback, and its message quotes the value, so it is not logged.
                self.server.bad_request(self.context.remote_ip, "invalid header value")
                raise ParseAbort(400) from None
        hosts = sum(1 for raw_name, _ in self._raw_headers
                    if len(raw_name) == 4 and raw_name.lower() == b"host")
        if len(self._raw_headers) > FREE_HEADER_LINES:   # each a call into Python: a turn's cost
            self._steps += len(self._raw_headers) - FREE_HEADER_LINES
        self._raw_headers = []
        ex.start_line = httputil.RequestStartLine(method, target, version)
        ex.headers = headers
        if factory is self.server.delegate and isinstance(headers, httputil.HTTPHeaders):
            # The application's own routes: a body that brings no credentials
            # is not kept past a small cap (service.http.app.ServiceApplication).
            limit_of = getattr(factory, "body_limit", None)
            limit = limit_of(target, headers) if limit_of is not None else None
            if limit is not None:
                size, refuse = limit
                if refuse:
                    ex.max_body = min(ex.max_body, size)
                else:
                    ex.body_kept = size
        ex.head = method == "HEAD"
        ex.keep_alive = bool(parser.should_keep_alive())
        if version not in ("HTTP/1.1", "HTTP/1.0"):
            raise ParseAbort(505)
        if version == "HTTP/1.1" and hosts != 1 or hosts > 1:
            raise ParseAbort(400)  # RFC 9112 3.2: none or several Host: a server MUST answer 400
        coding = headers.get("transfer-encoding")
        if coding is not None and coding.strip(_OWS).lower() != "chunked":
            # Not chunked last: the body cannot be framed (RFC 9112 6.3), 400.
            # Chunked after another coding: llhttp accepts it, but no coding
            # other than chunked is decoded here, so it is not implemented.
            last = coding.rpartition(",")[2].strip(_OWS).lower()
            raise ParseAbort(501 if last == "chunked" else 400)
        declared = headers.get("content-length")
        if declared is not None:
            ex.declared = content_length(declared)
        elif headers.get("transfer-encoding") is None:
            ex.declared = 0  # no body at all (RFC 9112 6.3)
        # llhttp's own flag is set only after this callback: same rule here.
        upgrade = headers.get("upgrade") is not None and "upgrade" in [
            token.strip(_OWS) for token in headers.get("connection", "").lower().split(",")]
        if upgrade or method == "CONNECT":
            # No protocol switch or tunnel is served: the answer says the
            # connection closes after it (RFC 9112 9.6), as it does.
            ex.close_after = True
        if upgrade and ex.declared != 0:
            # llhttp leaves the body of an Upgrade request to the new protocol.
            # No protocol switch is served (the connection closes after the
            # answer), so a declared body is read here, by hand; a chunked one
            # cannot be framed without the parser and is refused.
            if ex.declared is None:
                raise ParseAbort(400)
            ex.manual_body = True
        ex.expect_continue = (version == "HTTP/1.1"
                              and headers.get("expect", "").lower() == "100-continue")
        self.deadline = self.loop.time() + ex.body_timeout
        self._push(self._start, ex, None)
        if ex.declared is not None and ex.declared > ex.max_body:
            # The backstop comes after the handler's own checks (the invoke
            # endpoint answers 404/401/its plan's 413 first); the body is not read.
            raise ParseAbort(413)
        if ex.expect_continue:
            self._push(self._maybe_continue, ex, None)

    def on_body(self, body: bytes) -> None:
        ex = self._parsing
        assert ex is not None
        self._body_part(ex, body)

    def on_message_complete(self) -> None:
        ex = self._parsing
        assert ex is not None
        if self._raw_headers:
            # Trailer lines of a chunked body: each a call into Python, charged
            # to the turn in full (a review, session 30: 99 a request went free).
            self._steps += len(self._raw_headers)
            self._raw_headers = []
        if ex.manual_body:
            self._manual = ex  # complete once its body was read by hand
            self._manual_left = ex.declared or 0
            return
        self._parsing = None
        self._push(self._complete, ex, None)
