"""`make_app(context)`: the Tornado `Application` built from each module's `routes`."""

from __future__ import annotations

from tornado.web import Application

from service import health, invoke
from service.base import NotFoundHandler
from service.context import AppContext


def make_app(context: AppContext) -> Application:
    """The service's Tornado application; every handler gets `context`."""
    handlers = [
        (pattern, handler, {"context": context})
        for module in (invoke, health)
        for pattern, handler in module.routes
    ]
    return Application(
        handlers,  # type: ignore[arg-type]
        default_handler_class=NotFoundHandler,
        default_handler_args={"context": context},
        xheaders=False,  # client IPs come from service.event.client_ip, never blindly
        compress_response=False,
    )
