"""Test calls and replays: who may run one, on what, with which request.

A test call runs a request through the endpoint's whole pipeline (the plan's
body size and per-minute quota, the sandbox, history, error log and
statistics) but is authorised by the caller's role in the guild instead of
the endpoint secret.  A replay is a test call whose request is a stored
history record.  Both are marked as test calls (`test: true` in history,
`testCalls` in statistics) and count once against the endpoint's quota, like
any request.

The rules here (role, plan, input, the stored request) are shared by every
front; running the request is the HTTP layer's part
(`service.http.testcall.run_test_call`), since only it owns the sandbox pool.

Decisions:
- a test call works on a **disabled** endpoint and ignores the IP whitelist:
  the console exists to try a script before switching it on, and the caller
  is the API client, not an outside address.  A plan without endpoints
  refuses it (409 `plan_feature`).
- only POST is run, as on the invoke path (anything else would never run live).
- secret headers given to a test call are dropped before the script sees them.
- a record whose body was cut when stored (over 8 KB) cannot be replayed
  (409 `body_truncated`): running a different body would be a lie.
"""
from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping
from urllib.parse import urlencode

from models import RequestRecord
from service.core.access import EDITORS, Actor, guild_and_script
from service.core.errors import ConflictError, NotFoundError, QuotaError, ValidationError
from service.core.inputs import stored_request_id
from service.core.invoke_target import InvokeTarget, load_target
from service.core.reads import in_history
from service.core.records import SECRET_HEADERS
from service.plans import DEFAULT_PLANS, Plan, resolve_plan

MAX_HEADERS = 50
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,100}")


@dataclass(frozen=True)
class TestRequest:
    """The request a test call runs: as the invoke path would receive it."""

    method: str
    query: str                                   # raw query string, without "?"
    headers: dict[str, str] = field(default_factory=dict)   # lower-case names
    body: bytes = b""
    replay_of: str | None = None                 # the request id a replay repeats


def test_target(actor: Actor, guild_id: str, script_id: str, *,
                plans: Mapping[str, Plan] = DEFAULT_PLANS) -> InvokeTarget:
    """The endpoint a test call runs on.  Raises `NotFoundError` (also for a
    stranger), `PermissionDeniedError`, `QuotaError` (`plan_feature`: the
    plan has no endpoints)."""
    guild, script, _ = guild_and_script(actor, guild_id, script_id, "run test calls", EDITORS)
    plan = resolve_plan(plans, guild.plan)
    if plan.endpoints <= 0:
        raise QuotaError(f"plan {plan.name} does not include endpoints", code="plan_feature")
    target = load_target(guild.id, script.public_id, plans)
    if target is None:      # deleted between the two reads
        raise NotFoundError(f"script {script_id} not found", code="script_not_found")
    return target


def new_test_request(method: str = "POST", headers: Mapping[str, str] | None = None,
                     body: Any = None, query: str | Mapping[str, Any] | None = None) -> TestRequest:
    """Build a test request from API input.  `body`: a string is sent as is
    (text/plain unless a Content-Type is given), any other JSON value is sent
    as JSON.  Raises `ValidationError`."""
    if method.upper() != "POST":
        raise ValidationError("the invoke path runs POST requests only", code="invalid_method")
    clean: dict[str, str] = {}
    for name, value in (headers or {}).items():
        if len(clean) >= MAX_HEADERS:
            raise ValidationError(f"at most {MAX_HEADERS} headers", code="invalid_headers")
        if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
            raise ValidationError(f"invalid header name {str(name)[:40]!r}", code="invalid_headers")
        if (not isinstance(value, str) or any(c in value for c in "\r\n\x00")
                or not _encodable(value)):
            raise ValidationError(f"invalid value for header {name}", code="invalid_headers")
        if name.lower() not in SECRET_HEADERS:
            clean[name.lower()] = value
    if body is None:
        raw = b""
    elif isinstance(body, str):
        raw = body.encode("utf-8", "surrogatepass")
        clean.setdefault("content-type", "text/plain; charset=utf-8")
    else:
        raw = json.dumps(body, separators=(",", ":")).encode()
        clean.setdefault("content-type", "application/json")
    if isinstance(query, Mapping):
        pairs = list(_query_pairs(query))
        bad = next((n for n, v in pairs if not (_encodable(n) and _encodable(v))), None)
        if bad is not None:
            raise ValidationError(f"query argument {ascii(bad)[:40]} is not valid Unicode text "
                                  "(a lone surrogate?)", code="invalid_query")
        query_text = urlencode(pairs)
    else:
        query_text = (query or "").lstrip("?")
        if not _encodable(query_text):
            raise ValidationError("the query string is not valid Unicode text (a lone surrogate?)",
                                  code="invalid_query")
    return TestRequest("POST", query_text, clean, raw)


def _encodable(text: str) -> bool:
    """False for text UTF-8 cannot encode (a lone surrogate, as JSON's "\\ud800" gives)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _query_pairs(query: Mapping[str, Any]) -> Any:
    for name, value in query.items():
        for item in value if isinstance(value, list) else [value]:
            yield str(name), str(item)


def replay_request(actor: Actor, guild_id: str, script_id: str, request_id: str, *,
                   plans: Mapping[str, Plan] = DEFAULT_PLANS) -> tuple[InvokeTarget, TestRequest]:
    """The endpoint and the stored request to run again.  Raises
    `NotFoundError` (`request_not_found`), `ConflictError` (`body_truncated`),
    and what `test_target` raises."""
    target = test_target(actor, guild_id, script_id, plans=plans)
    # Only a record the history lists (the plan's newest N) can be replayed.
    rid = stored_request_id(request_id)
    row = (RequestRecord.select()
           .where(in_history(target.endpoint_id, target.plan.history)
                  & (RequestRecord.request_id == rid))
           .order_by(RequestRecord.id.desc()).first()
           if target.plan.history > 0 and rid is not None else None)
    if row is None:
        raise NotFoundError(f"request {rid or '(not a request id)'} not found in this "
                            "endpoint's history", code="request_not_found")
    if row.body_truncated:
        raise ConflictError("the stored body was cut at 8 KB, so the request cannot be replayed",
                            code="body_truncated")
    body = (base64.b64decode(row.body) if row.body_encoding == "base64"
            else str(row.body).encode("utf-8"))
    query = urlencode(list(_query_pairs(json.loads(row.query or "{}"))))
    headers = {str(k): str(v) for k, v in json.loads(row.headers or "{}").items()
               if str(k) not in SECRET_HEADERS}
    return target, TestRequest(str(row.method or "POST"), query, headers, body,
                               replay_of=row.request_id)
