"""The listening sockets of front processes that share one port.

With `server.processes` above 1 every front gets its own listening sockets on
the same address (SO_REUSEPORT: the kernel spreads connections over them).
SO_REUSEPORT also lets another process of the same user share a port that is
already in use: a second installation started on it took half of the first
one's requests (review, session 27). So a plain bind comes first: it fails, as
a single process's bind does, with "Address already in use".
"""
from __future__ import annotations

import socket

from tornado.netutil import bind_sockets


def refuse_a_port_in_use(host: str | None, port: int) -> None:
    """Raise OSError (EADDRINUSE) when something listens on `host`:`port` (0: any
    free port, nothing to check)."""
    if port:
        for probe in bind_sockets(port, host, family=socket.AF_UNSPEC):
            probe.close()


def bind_shared(host: str | None, port: int, count: int) -> list[list[socket.socket]]:
    """`count` sets of listening sockets on one address (the port chosen by the
    first set when `port` is 0); raises OSError when the address is in use."""
    refuse_a_port_in_use(host, port)
    first = bind_sockets(port, host, family=socket.AF_UNSPEC, reuse_port=True)
    port = first[0].getsockname()[1]
    return [first] + [bind_sockets(port, host, family=socket.AF_UNSPEC, reuse_port=True)
                      for _ in range(1, count)]


def rejoin(host: str | None, port: int) -> list[socket.socket]:
    """A new set of listening sockets in the group `bind_shared` made (its
    other sockets still open); raises OSError."""
    return bind_sockets(port, host, family=socket.AF_UNSPEC, reuse_port=True)
