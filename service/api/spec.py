"""Operations and the OpenAPI 3.1 document, built from the handlers themselves.

Each handler method carries an `Operation` (the `operation` decorator): who
may call it, its query and body models, its response model, status and
headers, and the error statuses it may answer.  `openapi_document(routes)`
walks the route list (path templates such as ``/api/v1/guilds/{guildId}``)
and the pydantic models of `service.api.schemas`, so the document cannot
drift from what the handlers validate and answer.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from service.api import schemas

F = TypeVar("F", bound=Callable[..., Any])
METHODS = ("get", "post", "put", "patch", "delete")
_PARAM = re.compile(r"\{(\w+)\}")

#: What every authenticated operation may answer, besides its own errors.
COMMON_ERRORS = {400: "Bad input (`invalid_input`, `invalid_body`, ...).",
                 401: "No valid token (`unauthorized`).",
                 403: "The role does not allow it (`forbidden`, `owner_only`).",
                 404: "Unknown or invisible guild, script or record.",
                 413: "The request body is too large (`payload_too_large`).",
                 429: "Rate limited (`rate_limited`, `auth_throttled`)."}
ERROR_TEXT = {409: "The plan refuses it or it clashes (`endpoint_quota`, `script_quota`, "
                   "`plan_feature`, `manager_limit`, ...).",
              412: "`If-Match` names another revision (`version_mismatch`).",
              422: "The source does not compile (`compile_error`, with `errors`).",
              503: "No sandbox worker was free (`busy`)."}


@dataclass(frozen=True)
class Operation:
    """One method on one path, as the OpenAPI document describes it."""

    operation_id: str
    summary: str
    who: str
    response: type[BaseModel] | None
    status: int = 200
    body: type[BaseModel] | None = None
    query: type[BaseModel] | None = None
    errors: tuple[int, ...] = ()
    response_headers: dict[str, str] = field(default_factory=dict)
    request_headers: dict[str, str] = field(default_factory=dict)
    public: bool = False
    tag: str = "admin"
    links: dict[str, tuple[str, dict[str, str]]] = field(default_factory=dict)


#: Path parameters: the shapes the service accepts (anything else is 400 or 404).
PATH_PARAMS: dict[str, dict[str, Any]] = {
    "guildId": {"type": "string", "pattern": "^[0-9]{1,25}$"},
    "scriptId": {"type": "string", "pattern": "^logic_[A-Za-z0-9_-]{22}$"},
    "userId": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
    "tokenId": {"type": "string", "pattern": "^[0-9]{1,18}$"},
    "requestId": {"type": "string", "minLength": 1, "maxLength": 64},
}


def operation(operation_id: str, summary: str, who: str, response: type[BaseModel] | None, *,
              status: int = 200, body: type[BaseModel] | None = None,
              query: type[BaseModel] | None = None, errors: Sequence[int] = (),
              response_headers: dict[str, str] | None = None,
              request_headers: dict[str, str] | None = None, public: bool = False,
              tag: str = "admin",
              links: dict[str, tuple[str, dict[str, str]]] | None = None) -> Callable[[F], F]:
    """Attach an `Operation` to a handler method.  `links`: OpenAPI links from
    the success response, name -> (operationId, {parameter: runtime expression})."""
    op = Operation(operation_id, summary, who, response, status, body, query, tuple(errors),
                   dict(response_headers or {}), dict(request_headers or {}), public, tag,
                   dict(links or {}))

    def mark(method: F) -> F:
        method.__operation__ = op  # type: ignore[attr-defined]
        return method
    return mark


def operation_of(handler: type, method: str) -> Operation | None:
    return getattr(getattr(handler, method, None), "__operation__", None)


def route_pattern(template: str) -> str:
    """`/api/v1/guilds/{guildId}` -> a Tornado pattern with named groups."""
    return _PARAM.sub(lambda m: f"(?P<{m.group(1)}>[^/]+)", template)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _query_parameters(model: type[BaseModel]) -> list[dict[str, Any]]:
    schema = model.model_json_schema()
    out = []
    for name, prop in schema.get("properties", {}).items():
        prop = dict(prop)
        description = prop.pop("description", "")
        prop.pop("title", None)
        out.append({"name": name, "in": "query", "required": False, "schema": prop,
                    "description": description})
    return out


def _operation_object(template: str, op: Operation) -> dict[str, Any]:
    params: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True,
         "schema": PATH_PARAMS.get(name, {"type": "string"})}
        for name in _PARAM.findall(template)]
    if not op.public:
        params.append({"name": "X-Acting-User", "in": "header", "required": False,
                       "schema": {"type": "string"},
                       "description": "Operator tokens only: act as this user."})
    for name, description in op.request_headers.items():
        params.append({"name": name, "in": "header", "required": False,
                       "schema": {"type": "string"}, "description": description})
    if op.query is not None:
        params += _query_parameters(op.query)
    ok: dict[str, Any] = {"description": op.summary}
    if op.response is not None:
        ok["content"] = _json(op.response)
    if op.response_headers:
        ok["headers"] = {name: {"description": text, "schema": {"type": "string"}}
                         for name, text in op.response_headers.items()}
    if op.links:
        ok["links"] = {name: {"operationId": target, "parameters": params_}
                       for name, (target, params_) in op.links.items()}
    responses: dict[str, Any] = {str(op.status): ok}
    statuses = {} if op.public else dict(COMMON_ERRORS)
    for status in op.errors:
        statuses[status] = ERROR_TEXT.get(status, COMMON_ERRORS.get(status, "Error."))
    for status, text in sorted(statuses.items()):
        responses[str(status)] = {"description": text, "content": _json(schemas.ErrorBody)}
    obj: dict[str, Any] = {"operationId": op.operation_id, "summary": op.summary,
                           "description": f"Who: {op.who}.", "tags": [op.tag],
                           "parameters": params, "responses": responses}
    if op.body is not None:
        obj["requestBody"] = {"required": True, "content": _json(op.body)}
    obj["security"] = [] if op.public else [{"bearer": []}]
    return obj


def openapi_document(routes: Sequence[tuple[str, type]], *, version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `routes` (path template, handler class)."""
    paths: dict[str, Any] = {}
    models: dict[type[BaseModel], str] = {schemas.ErrorBody: "serialization"}
    for template, handler in routes:
        item: dict[str, Any] = {}
        for method in METHODS:
            op = operation_of(handler, method)
            if op is None:
                continue
            item[method] = _operation_object(template, op)
            if op.body is not None:
                models[op.body] = "validation"
            if op.response is not None:
                models[op.response] = "serialization"
        if item:
            paths[template] = item
    _, defs = models_json_schema([(m, mode) for m, mode in    # type: ignore[misc]
                                  sorted(models.items(), key=lambda i: i[0].__name__)],
                                 ref_template="#/components/schemas/{model}")
    return {
        "openapi": "3.1.0",
        "info": {"title": "Logic Endpoints admin API", "version": version,
                 "description": "Manage guilds, scripts and endpoints. See docs/admin-api.md."},
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "An API token `lat_...`."}},
        },
    }
