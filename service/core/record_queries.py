"""Filtered reads of request history and the error log, and one record in full.

`history_page` / `error_page` narrow what `service.core.reads` lists: newest
first, at most `limit`, only `status` (`2xx`, `4xx`, `5xx` or one code), only
at or after `since`.  Records keep the `--json` shape of `logic history` /
`logic errors` (`service.core.reads.record_view` / `error_view`).  An error record's status is the one its kind
answers (`ERROR_STATUS`).
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Mapping

from models import ErrorRecord, RequestRecord
from service.core.access import Actor
from service.core.errors import NotFoundError, QuotaError, ValidationError
from service.core.inputs import ascii_digits, stored_request_id, user_time
from service.core.reads import _endpoint_and_plan, error_view, in_history, record_view
from service.core.records import ERROR_KEEP
from service.plans import DEFAULT_PLANS, Plan

#: The status each error kind answers the caller.
ERROR_STATUS: Mapping[str, int] = {"script_error": 500, "script_timeout": 504,
                                    "script_memory_exceeded": 500, "invalid_reply": 500,
                                    "no_endpoint_handler": 501, "crash": 500}


def parse_status(spec: str | None) -> tuple[int, int] | None:
    """`"4xx"` -> (400, 499), `"404"` -> (404, 404); raises `ValidationError`."""
    if spec is None:
        return None
    text = spec.strip().lower()
    if len(text) == 3 and text[0] in "12345" and text[1:] == "xx":
        low = int(text[0]) * 100
        return low, low + 99
    if ascii_digits(text, 3) and 100 <= int(text) <= 599:
        return int(text), int(text)
    raise ValidationError(f"invalid status filter {spec!r}: use 2xx, 4xx, 5xx or a code such as 404",
                          code="invalid_status")


def history_page(actor: Actor, guild_id: str, script_id: str, *,
                 plans: Mapping[str, Plan] = DEFAULT_PLANS, limit: int | None = None,
                 status: str | None = None, since: datetime | None = None) -> dict[str, Any]:
    """`{"records": [...]}` newest first, filtered.  Raises `ValidationError`
    (`invalid_status`, `invalid_since`), `NotFoundError`, `PermissionDeniedError`."""
    span = parse_status(status)
    when = user_time(since, field="since", code="invalid_since") if since is not None else None
    endpoint, plan = _endpoint_and_plan(actor, guild_id, script_id, "read history", plans)
    if plan.history <= 0:
        return {"records": []}
    # The plan's newest N are what history holds; filters narrow those.
    query = RequestRecord.select().where(in_history(endpoint.id, plan.history))
    if span is not None:
        query = query.where(RequestRecord.status.between(*span))
    if when is not None:
        query = query.where(RequestRecord.time >= when)
    query = query.order_by(RequestRecord.id.desc())
    if limit is not None:
        query = query.limit(limit)
    return {"records": [record_view(r) for r in query]}


def history_record(actor: Actor, guild_id: str, script_id: str, request_id: str, *,
                   plans: Mapping[str, Plan] = DEFAULT_PLANS) -> dict[str, Any]:
    """One request record in full, with its error record when there is one;
    only one of the plan's newest N (what `history_page` lists).  Raises
    `NotFoundError` (`record_not_found`), `PermissionDeniedError`."""
    endpoint, plan = _endpoint_and_plan(actor, guild_id, script_id, "read history", plans)
    rid = stored_request_id(request_id)
    row = (RequestRecord.select().where(in_history(endpoint.id, plan.history)
                                        & (RequestRecord.request_id == rid))
           .order_by(RequestRecord.id.desc()).first()
           if plan.history > 0 and rid is not None else None)
    if row is None:
        raise NotFoundError(f"no request {rid or '(not a request id)'!r} in the history of "
                            f"script {script_id}", code="record_not_found")
    view = record_view(row)
    error = (ErrorRecord.select().where((ErrorRecord.endpoint == endpoint.id)
                                        & (ErrorRecord.request_id == request_id)).first()
             if plan.error_logs else None)
    view["errorRecord"] = error_view(error) if error is not None else None
    return view


def error_page(actor: Actor, guild_id: str, script_id: str, *,
               plans: Mapping[str, Plan] = DEFAULT_PLANS, limit: int | None = None,
               status: str | None = None, since: datetime | None = None) -> dict[str, Any]:
    """`{"errors": [...]}` newest first, filtered (status by `ERROR_STATUS`).
    Raises `QuotaError` (`plan_feature`), `ValidationError`, `NotFoundError`,
    `PermissionDeniedError`."""
    span = parse_status(status)
    when = user_time(since, field="since", code="invalid_since") if since is not None else None
    endpoint, plan = _endpoint_and_plan(actor, guild_id, script_id, "read error logs", plans)
    if not plan.error_logs:
        raise QuotaError(f"plan {plan.name} does not include error logs", code="plan_feature")
    query = ErrorRecord.select().where(ErrorRecord.endpoint == endpoint.id)
    if span is not None:
        kinds = [k for k, s in ERROR_STATUS.items() if span[0] <= s <= span[1]]
        query = query.where(ErrorRecord.kind.in_(kinds or [""]))
    if when is not None:
        query = query.where(ErrorRecord.time >= when)
    query = query.order_by(ErrorRecord.id.desc()).limit(min(limit or ERROR_KEEP, ERROR_KEEP))
    return {"errors": [error_view(r) for r in query]}
