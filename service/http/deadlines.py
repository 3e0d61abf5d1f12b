"""Deadlines of a `Connection`, enforced by the listener's sweep about every second,
and what the kernel may hold for a client that does not read (SO_SNDBUF, RST).

The head must arrive within `idle_timeout` (else 408), a body within
`body_timeout`, an idle keep-alive connection closes after `idle_timeout`, a
lingering one after `linger_seconds`; and the send timeout: a client that does
not take `min_send_progress` bytes of its answers (or all that waited, when
less) within `idle_timeout` is cut off, however much it still sends and
whatever its handler is doing. A slow reader that keeps reading is not cut
off: only bytes the client took count as progress, and only enough of them
(one that took a few bytes every ~50 s held its connection for ever).
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
from typing import TYPE_CHECKING

from service.http.wire import log

if TYPE_CHECKING:
    from service.http.connection import Connection


#: SO_LINGER on, 0 s: a close drops what the kernel still holds and sends an RST.
_RESET = struct.pack("ii", 1, 0)


def set_buffers(sock: socket.socket, send: int, receive: int) -> None:
    """Bound the kernel's buffers of an accepted socket (SO_SNDBUF, SO_RCVBUF;
    0 leaves one to autotuning; the kernel doubles each for its bookkeeping):
    with autotuning, a client that reads nothing pinned up to tcp_wmem's
    maximum (4 MiB) besides our own `write_high_water`, and one that grew our
    receive buffer with a few large bodies, then sent requests while reading
    nothing (reading paused), kept ~1.2 MiB queued in it (review, session 29)."""
    for option, size in ((socket.SO_SNDBUF, send), (socket.SO_RCVBUF, receive)):
        if size:
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, size)
            except OSError:
                pass


def drop(conn: Connection) -> None:
    """Cut a client that does not take its answers: at once, and with what the
    kernel holds for it (a plain close leaves that queue to drain for as long
    as the client takes a trickle of it, and sends the rest after our FIN)."""
    if conn.transport is None or conn.closed:
        return
    sock = conn.transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        except OSError:
            pass
    conn.close_now()


def pinned(conn: Connection) -> int:
    """Bytes `conn` holds in the server's memory: unsent answers, what was
    received and not yet parsed, body chunks of requests waiting their turn."""
    transport = conn.transport
    if transport is None or conn.closed:
        return 0
    return (transport.get_write_buffer_size() + len(conn._stash)
            + getattr(conn, "_queued_body", 0))


def unsent(conn: Connection) -> int:
    """Bytes of answers not yet read by the client: ours and the kernel's."""
    transport = conn.transport
    if transport is None or conn.closed:
        return 0
    pending = transport.get_write_buffer_size()
    if conn._fd >= 0:
        try:
            # The kernel's send queue: a slow reader drains it long before
            # the socket turns writable again and our buffer moves.
            pending += struct.unpack("i", fcntl.ioctl(conn._fd, termios.TIOCOUTQ,
                                                      b"\0\0\0\0"))[0]
        except OSError:
            conn._fd = -1
    return pending


def quiet(conn: Connection) -> bool:
    """Whether nothing is on its way either way: no request being served, no
    answer bytes unread by the client, no request bytes unread by us."""
    if not conn.idle or unsent(conn) or conn._stash:
        return False
    if conn._fd >= 0:
        try:
            unread: int = struct.unpack("i", fcntl.ioctl(conn._fd, termios.FIONREAD,
                                                         b"\0\0\0\0"))[0]
            return unread == 0
        except OSError:
            return False
    return True


def sweep(conn: Connection, now: float) -> None:
    """Called about every second: enforce the connection's deadline."""
    transport = conn.transport
    pending = unsent(conn)
    if pending:
        # An answer is still going out. A slow reader is not an idle
        # client: it has idle_timeout to take min_send_progress bytes (or
        # all that waited) each time, and the deadlines below start once
        # everything was handed over. Only bytes the client took count as
        # progress: a buffer that grows (more answers written) is not a
        # client that reads.
        delivered = conn._written - pending
        if not conn._last_pending or delivered - conn._progress_mark >= conn._progress_need:
            conn._progress = now
            conn._progress_mark = delivered
            conn._progress_need = min(pending, conn.limits.min_send_progress)
        conn._last_pending = pending
        if now - conn._progress < conn.limits.idle_timeout:
            return
        # A send timeout: the client did not take enough for idle_timeout,
        # whatever it still sends and whatever the handler is doing.
        if not conn.lingering:
            log.debug("closing connection from %s: answers not read", conn.context.remote_ip)
        drop(conn)
        return
    if conn._last_pending:
        conn._last_pending = 0
        wait = conn.limits.linger_seconds if conn.lingering else conn.limits.idle_timeout
        conn.deadline = max(conn.deadline, now + wait)
    if conn.deadline and now > conn.deadline:
        ex = conn._active
        if ex is not None and ex.request_done and not conn.lingering:
            return  # the request is being answered; its handler has the clock
        if not conn.lingering:
            log.debug("closing connection from %s: timed out", conn.context.remote_ip)
            if conn._in_head and not conn._queue and conn._active is None:
                conn._stop_parsing(408)  # a head that never ended: say so, then close
                return
        if transport is not None and transport.get_write_buffer_size():
            drop(conn)  # a client that stopped reading: drop what is buffered
        elif transport is not None and not conn.closed:
            # Gracefully: what the kernel still holds of an answer reaches a
            # slow reader before the FIN.
            transport.close()

