"""`Feeding`: how a connection's bytes reach its parser — in pieces, in turn.

A read is parsed a piece at a time (`_piece`), and parsing stops, the rest
held back with reading paused (`_stash`), while too many requests wait for
their turn, their queued bodies reach QUEUED_BODY_BYTES or answers are not
read; and until a later turn of the event loop once this connection began
REQUESTS_PER_TURN requests in this one, or all connections together the
front's budget (`service.http.turns`). What the parser calls back for beyond
an ordinary request (a body's parts past its first few, header lines past
32) counts too, STEPS_PER_REQUEST of them as one request. Body chunks of a
request that wait in the queue one after another are one step.
`ParsingConnection` adds the parser and its callbacks.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING

from service.http.connection import Connection
from service.http.exchange import Exchange
from service.http.wire import ParseAbort

if TYPE_CHECKING:
    from service.http.listener import HTTP1Server

#: Bytes parsed at a time, so that a large read cannot queue unbounded
#: requests: heads (and chunked bodies) a kilobyte at a time, 256 bytes while
#: requests wait their turn, so that past `max_pipelined` at most that much of
#: further heads is parsed (a 16 KiB slice of 41-byte requests once queued ~800
#: steps); a body of known length up to its end, 16 KiB at a time.
_SLICE = 1024
_SMALL_SLICE = 256
_BODY_SLICE = 16384
#: Requests one connection may begin before the loop serves the others: past
#: it, the rest of what it sent waits for the loop's next turn (review, session
#: 29: one client pipelining requests answered at once, 404s, held the loop for
#: as long as it sent, and every other client waited ~9 s).
REQUESTS_PER_TURN = 32
#: Body bytes of requests waiting their turn before parsing stops (chunks of one
#: request queued one after another are one step: tiny chunks queued thousands).
QUEUED_BODY_BYTES = 65536
#: Parser callbacks past an ordinary request's that cost a turn one request:
#: each body part past a request's first FREE_PARTS, each header line past its
#: first FREE_HEADER_LINES. A chunked body of 1-byte chunks is ~170 parts a
#: kilobyte, each a call into Python; counted only as the one request it
#: belongs to, 200 such uploads from one address held the loop for 20 s and
#: more between other clients' turns (review, session 30).
STEPS_PER_REQUEST = 16
FREE_PARTS = 4
FREE_HEADER_LINES = 32


class Feeding(Connection):
    """The feeding of a parser: pieces, turns, queued bodies (see the module docstring)."""

    def __init__(self, server: HTTP1Server) -> None:
        super().__init__(server)
        self._begun = 0  # requests begun so far
        self._steps = 0  # parser callbacks counted past ordinary requests' (STEPS_PER_REQUEST)
        self._parts = 0  # body parts of the request being parsed
        self._turn_spent = 0  # `_spent()` when this turn of the loop began (REQUESTS_PER_TURN)
        self._queued_body = 0  # body bytes in queued steps
        #: Steps (about two per request) allowed to wait before parsing stops.
        self._max_queue = 2 * self.limits.max_pipelined

    def _feed_slice(self, data: bytes) -> None:
        raise NotImplementedError   # the parser's (ParsingConnection)

    def _spent(self) -> int:
        """What this connection has cost its turns so far, in requests."""
        return self._begun + self._steps // STEPS_PER_REQUEST

    def data_received(self, data: bytes) -> None:
        if self.lingering or self._broken:
            return  # dropped: we are closing, or the stream can no longer be parsed
        if self._stash:
            self._stash += data  # a read already under way when reading paused
            return
        self._feed(data)

    def _feed_stash(self) -> None:
        if not self._feeding and not self.lingering and not self._broken:
            data, self._stash = self._stash, b""
            self._feed(data)

    def _feed(self, data: bytes) -> None:
        """Parse `data` a slice at a time; hold the rest back (reading paused)
        while too many requests wait for their turn or answers are not read,
        or until a later turn of the loop once this connection began
        REQUESTS_PER_TURN requests in this one, or all connections together
        the front's budget (`service.http.turns`)."""
        turns = self.server.turns
        if turns.used >= turns.budget:
            self._stash = data   # parsed at a later turn, in its address's turn
            self._end_turn()
            return
        if self._manual is not None:
            self._feed_manual(data)
            return
        spent = self._begun + self._steps // STEPS_PER_REQUEST   # _spent(), inline: per read
        size = len(data)
        if size <= _SLICE and self._parsing is None and not self._blocked \
                and not self._write_paused and not self._queue or size <= self._piece():
            # One piece: a request's whole head and body, or the body a client
            # sent after its head, most often.
            self._feed_slice(data)
            now = self._begun + self._steps // STEPS_PER_REQUEST
            if now != spent:
                turns.used += now - spent
                if now - self._turn_spent >= REQUESTS_PER_TURN or turns.used >= turns.budget:
                    self._end_turn()
            return
        self._feeding = True
        try:
            view = memoryview(data)
            start = 0
            while start < len(data):
                piece = bytes(view[start:start + self._piece()])
                start += len(piece)
                self._feed_slice(piece)
                now = self._spent()
                charged = now != spent   # this piece began requests, or parsed much
                if charged:
                    turns.used += now - spent
                    spent = now
                if self.lingering or self._broken:
                    return
                if self._manual is not None:
                    self._feed_manual(bytes(view[start:]))
                    return
                if self._write_paused or len(self._queue) >= self._max_queue \
                        or self._queued_body >= QUEUED_BODY_BYTES:
                    if start < len(data):
                        self._stash = bytes(view[start:])
                        self._pause_reading()
                    return
                if charged and (now - self._turn_spent >= REQUESTS_PER_TURN
                                or turns.used >= turns.budget):
                    if start < len(data):
                        self._stash = bytes(view[start:])
                    self._end_turn()
                    return
        finally:
            self._feeding = False

    def _piece(self) -> int:
        """How many bytes to parse next (see _SLICE)."""
        ex = self._parsing
        if ex is not None and not self._in_head and ex.declared is not None:
            return max(1, min(ex.declared - ex.received, _BODY_SLICE))   # in its body
        if self._queue or self._blocked or self._write_paused:
            return _SMALL_SLICE
        return _SLICE

    def _end_turn(self) -> None:
        """Read nothing more from this client until a later turn of the loop
        (the other connections' reads and answers run first, `Turns`), then
        go on with what was held back."""
        self._pause_reading()
        self.server.turns.wait(self)

    def next_turn(self) -> None:
        """This connection's turn again (`Turns`)."""
        self._turn_spent = self._spent()
        if not self.closed:
            self._drain_queue()

    def _body_part(self, ex: Exchange, body: bytes) -> None:
        ex.received += len(body)
        self._parts += 1
        if self._parts > FREE_PARTS:
            self._steps += 1
        if ex.received > ex.body_kept or (ex.declared or 0) > ex.body_kept:
            pass   # read and dropped: the handler refuses the request for what it lacks
        elif self._blocked or self._queue or self._write_paused:
            # Counted until it runs; chunks of a request that follow each other
            # in the queue are one step (merged into a bytearray).
            self._queued_body += len(body)
            queue = self._queue
            if queue and queue[-1][1] is ex and queue[-1][0] == self._waited_body:
                step, _, part = queue[-1]
                if not isinstance(part, bytearray):
                    part = bytearray(part)
                    queue[-1] = (step, ex, part)
                part.extend(body)
            else:
                self._push(self._waited_body, ex, body)
        else:
            self._push(self._body, ex, body)  # the handler's own cap answers first
        if ex.received > ex.max_body:
            raise ParseAbort(413)

    def _waited_body(self, ex: Exchange, chunk: bytes | bytearray) -> Awaitable[None] | None:
        """Body bytes that waited in the queue (see _body_part)."""
        self._queued_body -= len(chunk)
        return self._body(ex, bytes(chunk) if isinstance(chunk, bytearray) else chunk)

    def _feed_manual(self, data: bytes) -> None:
        """The body of an Upgrade request (see on_headers_complete); while
        requests wait, at most what QUEUED_BODY_BYTES leaves room for, the
        rest held back with reading paused."""
        ex = self._manual
        assert ex is not None
        if self._stash:   # an earlier part of this read is held back already
            self._stash += data
            return
        room = self._manual_left
        if self._queue or self._blocked or self._write_paused:
            room = min(room, max(QUEUED_BODY_BYTES - self._queued_body, 0))
        part = data[:room]
        if len(part) < len(data) and len(part) < self._manual_left:
            self._stash = data[len(part):]
            self._pause_reading()
        self._manual_left -= len(part)
        try:
            if part:
                self._body_part(ex, part)
        except ParseAbort as exc:
            self._manual = None
            self._stop_parsing(exc.status)
            return
        if self._manual_left == 0:
            self._manual = None
            self._parsing = None
            self._push(self._complete, ex, None)
            self._stop_parsing(0)  # what follows belongs to the refused protocol: close
