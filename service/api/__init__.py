"""The admin JSON API under `/api/v1` (docs/admin-api.md).

Handlers in the manner of jupyter_server's `services/*/handlers.py`: each
checks its input with a `service.api.schemas` model, calls the service layer
(`service.core`) in the API's thread pool and serialises the result; each
module ends with its `routes` (path templates).  `service.api.base` owns
authentication and limits; `service.api.spec` builds the OpenAPI document
from the same operations and models.  This package may import
`service.core`, `service.http` (base handler, errors, the test-call runner)
and `models` only for transactions.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from service.api import endpoints, guilds, reads, scripts, tokens
from service.api.base import ApiState
from service.api.spec import openapi_document, route_pattern

if TYPE_CHECKING:
    from service.http.context import AppContext

API_VERSION = "1.0.0"
TEMPLATES: list[tuple[str, type]] = [
    route for module in (guilds, scripts, endpoints, reads, tokens) for route in module.routes]


def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of every route."""
    return openapi_document(TEMPLATES, version=API_VERSION)


def routes(context: AppContext) -> list[tuple[str, type, dict[str, Any]]]:
    """Tornado routes of the API, sharing one `ApiState` (thread pool, token cache)."""
    state = ApiState(context)
    tokens.OpenApiHandler.document_json = json.dumps(document(), separators=(",", ":")).encode()
    return [(route_pattern(template) + "/?", handler, {"context": context, "api": state})
            for template, handler in TEMPLATES]
