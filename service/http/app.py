"""`make_app(context)`: the Tornado `Application` built from each module's `routes`.

The invoke endpoint is not among them: `service.http.connection` routes ``/endpoints/``
straight to `service.http.invoke.InvokeEndpoint`.
"""

from __future__ import annotations

import functools
import logging

from tornado.web import Application, RequestHandler

from service import api, dashboard
from service.chat import handler as chat
from service.http import health, metrics_handler
from service.http.base import NotFoundHandler
from service.http.context import AppContext
from service.http.metrics import Metrics
from service.http.redaction import loggable_path


access_log = logging.getLogger("logic.access")


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


def make_app(context: AppContext) -> Application:
    """The service's Tornado application; every handler gets `context`."""
    handlers = [
        (pattern, handler, {"context": context})
        for module in (health, metrics_handler)
        for pattern, handler in module.routes
    ]
    handlers += chat.routes(context)  # the interactions endpoint, when a public key is set
    handlers += api.routes(context)  # /api/v1 (service.api)
    handlers += dashboard.routes(context)
    return Application(
        handlers,
        default_handler_class=NotFoundHandler,
        default_handler_args={"context": context},
        xheaders=False,  # client IPs come from service.http.event.client_ip, never blindly
        compress_response=False,
        log_function=functools.partial(log_request, metrics=context.metrics),
    )
