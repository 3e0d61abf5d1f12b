"""The HTTP/1.1 layer's shared pieces: limits, status phrases, the `Date` value, parse aborts.

Used by `service.http.exchange` (one request and its answer),
`service.http.parsing` (llhttp's callbacks), `service.http.connection` (one
client connection) and `service.http.listener` (the server).
"""

from __future__ import annotations

import ipaddress
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from tornado import httputil

log = logging.getLogger("logic.http")

#: Renders the body of an error the connection itself answers (bad request,
#: head too large...): status -> (headers, body). Set by the service.
ErrorRenderer = Callable[[int], tuple[list[tuple[str, str]], bytes]]

REASONS = {status.value: status.phrase for status in HTTPStatus}
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
REQUEST_LINE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,32} ([\x21-\x7e]+) HTTP/1\.[01]\r?\n")
LAST_CHUNK = b"0\r\n\r\n"


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Connection limits; see the module docstring for what each one does."""

    max_header_bytes: int = 65536
    #: Header lines in one request head (Apache's LimitRequestFields): past it, 431.
    max_header_lines: int = 100
    max_body_bytes: int = 100 * 1024 * 1024
    idle_timeout: float = 60.0
    #: A head must end this long after its first byte (nginx's client_header_timeout).
    head_timeout: float = 10.0
    #: Bytes that incomplete heads may hold together; past it the oldest is shed.
    head_budget_bytes: int = 32 * 1024 * 1024
    body_timeout: float = 30.0
    linger_seconds: float = 2.0
    #: An early answer keeps the connection when at most this much body is left.
    keep_alive_discard: int = 65536
    sweep_interval: float = 1.0
    #: Requests parsed ahead of the one being answered (pipelining depth).
    max_pipelined: int = 64
    #: Unsent answer bytes above which the connection stops reading requests.
    write_high_water: int = 256 * 1024
    #: SO_SNDBUF of each accepted socket (the kernel doubles it); 0: the kernel's
    #: autotuning (up to tcp_wmem's maximum, often 4 MiB per connection).
    socket_send_buffer: int = 128 * 1024
    socket_receive_buffer: int = 128 * 1024
    #: Requests all connections may begin in one turn of the event loop
    #: (`service.http.turns`); past it the rest wait, round robin by address.
    requests_per_turn: int = 128
    #: Bytes that connections may pin together in the server's memory (unsent
    #: answers, what was received and not yet parsed, queued body chunks),
    #: checked at every sweep; past it those holding most are cut. 0: none.
    buffer_budget_bytes: int = 256 * 1024 * 1024
    #: While answers wait, the client must take this much of them (or all that
    #: waited) per idle_timeout, or the connection is cut (the send timeout).
    min_send_progress: int = 64 * 1024


_date: dict[int, str] = {}


def http_date() -> str:
    """The current time as an HTTP `Date` value (formatted once per second)."""
    now = int(time.time())
    text = _date.get(now)
    if text is None:
        _date.clear()
        text = _date[now] = httputil.format_timestamp(now)
    return text


def plain_error(status: int) -> tuple[list[tuple[str, str]], bytes]:
    return [("Content-Type", "text/plain; charset=utf-8")], REASONS.get(status, "Error").encode()


class PeerContext:
    """What `HTTPServerRequest` reads from `connection.context`."""

    __slots__ = ("remote_ip", "protocol", "address")

    def __init__(self, address: Any) -> None:
        self.address = address
        self.remote_ip = address[0] if isinstance(address, tuple) and address else "0.0.0.0"
        self.protocol = "http"


def peer_group(ip: str, ipv6_prefix: int) -> str:
    """Whose share `ip` counts in (the per-address connection cap, the
    wrong-secret throttle): an IPv4 address itself (also IPv4-mapped), an IPv6
    address its network of `ipv6_prefix` bits: one subscriber's /64 holds more
    addresses than anyone could be made to run out of."""
    if ":" not in ip:
        return ip
    try:
        address = ipaddress.IPv6Address(ip)
    except ValueError:
        return ip
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(ipaddress.IPv6Network((address, ipv6_prefix), strict=False))


class ParseAbort(Exception):
    """Raised inside a parser callback to stop parsing with an HTTP status."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status

