"""`make_app(context)`: the Tornado `Application` built from each module's `routes`.

The invoke endpoint is not among them: `service.http.connection` routes ``/endpoints/``
straight to `service.http.invoke.InvokeEndpoint`.
"""

from __future__ import annotations

import functools
import logging
from urllib.parse import urlsplit

from tornado.httputil import HTTPHeaders
from tornado.routing import PathMatches
from tornado.web import Application, RequestHandler

from service import api, dashboard
from service.chat import handler as chat
from service.http import health, metrics_handler
from service.dashboard.base import signed_session_in
from service.http.base import BaseHandler, NotFoundHandler
from service.http.context import AppContext
from service.http.metrics import Metrics
from service.http.redaction import loggable_path
from service.settings import Settings


access_log = logging.getLogger("logic.access")

#: The body the front keeps of a request to the application (every path but
#: ``/endpoints/``) that cannot be authenticated before its body: past it the
#: body is read and dropped, and the handler refuses the request for what it
#: lacks. Such a body was held whole, up to the largest plan's body size,
#: before the handler could refuse it (review, session 25: 200 connections of
#: one address took a server from 63 to 267 MiB, and a first fix that trusted
#: any ``Authorization`` header or cookie was undone by sending one). The chat
#: path is refused past it at once (413, before the signature check). Two
#: kinds of request keep the front's backstop: the admin API's with an
#: ``Authorization`` header (it reads no byte of a body before the token is
#: known: ``service.api.base``), and the dashboard's with a session cookie this
#: service signed.
ANONYMOUS_BODY_CAP = 64 * 1024


class ServiceApplication(Application):
    """The application, with the body limit the front applies when a head arrives."""

    chat_path = ""
    service_settings: Settings

    def body_limit(self, path: str, headers: HTTPHeaders) -> tuple[int, bool] | None:
        """``(bytes, refuse)``: past ``bytes`` the body is refused (413) or, when
        not ``refuse``, read and dropped; None: the front's backstop alone."""
        route = path.split("?", 1)[0]
        if route == self.chat_path:
            return ANONYMOUS_BODY_CAP, True
        if route.startswith("/api/") and "Authorization" in headers:
            return None
        if (route.startswith("/dashboard/")
                and signed_session_in(headers.get("Cookie", ""), self.service_settings)):
            return None
        return ANONYMOUS_BODY_CAP, False

    def methods_for(self, target: str) -> list[str] | None:
        """The methods the route of a request target answers; None: no route,
        or one whose handler answers none (a "not found" catch-all)."""
        path = urlsplit(target).path
        for rule in self.wildcard_router.rules:
            matcher, handler = rule.matcher, rule.target
            if isinstance(matcher, PathMatches) and matcher.regex.match(path) \
                    and isinstance(handler, type) and issubclass(handler, BaseHandler):
                return handler.allowed_methods() or None
        return None


def log_request(handler: RequestHandler, metrics: Metrics | None = None) -> None:
    """Count the request (`logic_http_requests_total`) and log one access line.

    The line is at DEBUG (WARNING for the service's own failures).

    Client errors and script failures are normal traffic for an invoke service:
    logging each at WARNING would let a flood of bad requests fill the disk. The
    line names the request id, never the query string, a header or a body.
    """
    status = handler.get_status()
    code = getattr(handler, "error_code", None)
    if metrics is not None:
        metrics.http_answered(handler, status, code)
    internal = status >= 500 and code in (None, "internal_error")
    level = logging.WARNING if internal else logging.DEBUG
    if access_log.isEnabledFor(level):
        request = handler.request
        access_log.log(level, "%s %s %s %d %.1fms", getattr(handler, "request_id", "-"),
                       request.method, loggable_path(request.path), status,
                       1000.0 * request.request_time())


def make_app(context: AppContext) -> ServiceApplication:
    """The service's Tornado application; every handler gets `context`."""
    handlers = [
        (pattern, handler, {"context": context})
        for module in (health, metrics_handler)
        for pattern, handler in module.routes
    ]
    handlers += chat.routes(context)  # the interactions endpoint, when a public key is set
    handlers += api.routes(context)  # /api/v1 (service.api)
    handlers += dashboard.routes(context)
    app = ServiceApplication(
        handlers,
        default_handler_class=NotFoundHandler,
        default_handler_args={"context": context},
        xheaders=False,  # client IPs come from service.http.event.client_ip, never blindly
        compress_response=False,
        log_function=functools.partial(log_request, metrics=context.metrics),
    )
    app.chat_path = context.settings.chat.path if context.settings.chat.public_key else ""
    app.service_settings = context.settings
    return app
