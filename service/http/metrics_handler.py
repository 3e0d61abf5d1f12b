"""`GET /metrics`: the Prometheus scrape, and who may make it.

Access (docs/operations.md, "Metrics"): the TCP peer must be inside
`metrics.allow` (loopback by default; an empty list turns the route off); a
request that carries a forwarding header (`X-Forwarded-For`, `X-Real-IP`,
`Forwarded`) came through a proxy, whose own address says nothing about the
client, and is refused; with `metrics.token` set, `Authorization: Bearer
<token>` is required as well. A refused address gets the same 404 as an
unknown path; a wrong or missing token, 401. Both in the JSON error envelope.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Sequence

from service.http.base import BaseHandler
from service.http.errors import NotFoundError, UnauthorizedError
from service.http.metrics_export import CONTENT_TYPE
from service.settings_parsers import IPNetwork

#: Headers a proxy adds: their presence means the peer is not the client.
FORWARDING_HEADERS = ("X-Forwarded-For", "X-Real-IP", "Forwarded")


def peer_allowed(peer: str, allow: Sequence[IPNetwork]) -> bool:
    """True when the address `peer` (IPv4-mapped IPv6 read as IPv4) is inside `allow`."""
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address in net for net in allow)


def token_matches(header: str | None, token: str) -> bool:
    """`header` is ``Bearer <token>`` (compared in constant time)."""
    scheme, _, presented = (header or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        presented.strip().encode(), token.encode())


class MetricsHandler(BaseHandler):
    """The scrape: every metric in the Prometheus text format."""

    def prepare(self) -> None:
        conf = self.context.settings.metrics
        headers = self.request.headers
        if (not peer_allowed(self.request.remote_ip or "", conf.allow)
                or any(name in headers for name in FORWARDING_HEADERS)):
            raise NotFoundError()
        if conf.token and not token_matches(headers.get("Authorization"), conf.token):
            raise UnauthorizedError("A valid metrics token is required.",
                                    headers={"WWW-Authenticate": "Bearer"})

    def get(self) -> None:
        self.set_header("Content-Type", CONTENT_TYPE)
        self.set_header("Cache-Control", "no-store")
        self.finish(self.context.metrics_export.render())


routes = [(r"/metrics", MetricsHandler)]
