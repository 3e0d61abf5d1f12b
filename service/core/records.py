"""The record store: what the batched writer appends after requests.

`write_batch(items)` takes `RequestRecordIn` (history), `ErrorRecordIn` (error
log) and `StatHit` (statistics) items and, in ONE transaction:
- appends the request records, then prunes each touched endpoint to the
  `keep` newest (the plan's history size, carried by the item);
- appends the error records and prunes each endpoint to the last 100;
- adds every `StatHit` to per-minute (kept 24 h) and per-hour (kept 30 days)
  counters with a latency histogram, and counts caller IPs per hour.

Statistics come ONLY from `StatHit`: the HTTP layer sends one per request,
whatever its outcome (401/403/413/429 included), and a `RequestRecordIn` only
for requests that belong in history, so nothing is counted twice.

Secret headers (`authorization`, `x-service-secret`, cookies) are dropped
here as well as in the HTTP layer; bodies and output are capped at 8 KB with
a flag.  Items for an endpoint that no longer exists are dropped, so one
deleted script cannot make a whole batch fail.
"""
from __future__ import annotations

import base64
import bisect
import json
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Iterable, Sequence, Union

from peewee import EXCLUDED

from models import Endpoint, ErrorRecord, RequestRecord, StatBucket, StatIp, database
from models.clock import to_db, utcnow
from models.stats import HOUR, LATENCY_BOUNDS_MS, MINUTE, histogram_fields

BODY_CAP = 8192
OUTPUT_CAP = 8192
TEXT_CAP = 2048
ERROR_KEEP = 100
MINUTE_RETENTION = timedelta(hours=24)
HOUR_RETENTION = timedelta(days=30)
IP_RETENTION = timedelta(days=30)
SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "x-service-secret",
                            "cookie", "set-cookie"})
_CUT = "\n…[truncated]"


@dataclass(frozen=True)
class RequestRecordIn:
    """One request for the history (`keep`: the plan's history size)."""

    endpoint_id: int
    request_id: str
    time: datetime
    method: str
    query: dict[str, Any]
    headers: dict[str, str]
    body: bytes | str
    ip: str
    user_agent: str
    status: int
    response_headers: dict[str, str]
    response_body: bytes
    duration_ms: float
    output: str
    error: str | None
    keep: int


@dataclass(frozen=True)
class ErrorRecordIn:
    """One script failure for the error log."""

    endpoint_id: int
    request_id: str
    time: datetime
    kind: str
    message: str
    line: int | None
    traceback: str | None


@dataclass(frozen=True)
class StatHit:
    """One request outcome for the statistics (every outcome counts)."""

    endpoint_id: int
    time: datetime
    status: int
    duration_ms: float
    ip: str


Item = Union[RequestRecordIn, ErrorRecordIn, StatHit]


# ------------------------------------------------------------- sanitising
def redact_headers(headers: dict[str, Any] | Iterable[tuple[str, Any]]) -> dict[str, str]:
    """Lower-cased headers without the secret ones."""
    pairs = headers.items() if isinstance(headers, dict) else headers
    return {str(k).lower(): str(v) for k, v in pairs if str(k).lower() not in SECRET_HEADERS}


def cap_body(body: bytes | str | None, cap: int = BODY_CAP) -> tuple[str, str, bool]:
    """Return (stored text, encoding "text" | "base64", truncated)."""
    if body is None:
        return "", "text", False
    raw = body.encode("utf-8", "replace") if isinstance(body, str) else bytes(body)
    truncated = len(raw) > cap
    raw = raw[:cap]
    # A cut may split a UTF-8 sequence: drop up to 3 trailing bytes before
    # deciding that the body is binary.
    for trim in range(0, 4 if truncated else 1):
        try:
            return raw[: len(raw) - trim].decode("utf-8"), "text", truncated
        except UnicodeDecodeError:
            continue
    return base64.b64encode(raw).decode("ascii"), "base64", truncated


def cap_text(text: str | None, cap: int) -> str | None:
    """Cap a text field, marking the cut."""
    if text is None or len(text) <= cap:
        return text
    return text[:cap] + _CUT


def _bucket(time: datetime, granularity: str) -> datetime:
    time = to_db(time)
    if granularity == MINUTE:
        return time.replace(second=0, microsecond=0)
    return time.replace(minute=0, second=0, microsecond=0)


def latency_bin(duration_ms: float) -> int:
    """Index of the histogram bin for a duration."""
    return bisect.bisect_left(LATENCY_BOUNDS_MS, duration_ms)


# ------------------------------------------------------------------ write
def _request_row(item: RequestRecordIn) -> dict[str, Any]:
    body, body_enc, body_cut = cap_body(item.body)
    rbody, rbody_enc, rbody_cut = cap_body(item.response_body)
    return {
        "endpoint": item.endpoint_id, "request_id": item.request_id[:64],
        "time": to_db(item.time), "method": item.method[:16],
        "query": json.dumps(item.query)[:BODY_CAP],
        "headers": json.dumps(redact_headers(item.headers)),
        "body": body, "body_encoding": body_enc, "body_truncated": body_cut,
        "ip": item.ip[:45], "user_agent": (item.user_agent or "")[:TEXT_CAP],
        "status": item.status,
        "response_headers": json.dumps(redact_headers(item.response_headers)),
        "response_body": rbody, "response_body_encoding": rbody_enc,
        "response_body_truncated": rbody_cut, "duration_ms": float(item.duration_ms),
        "output": cap_text(item.output or "", OUTPUT_CAP), "error": cap_text(item.error, TEXT_CAP),
    }


def _prune(model: type[RequestRecord] | type[ErrorRecord], endpoint_id: int, keep: int) -> None:
    # Delete everything older than the keep-th newest id; when there are
    # fewer rows the subquery is empty (NULL) and nothing is deleted.
    if keep <= 0:
        model.delete().where(model.endpoint == endpoint_id).execute()
        return
    alias = model.alias()
    cutoff = (alias.select(alias.id).where(alias.endpoint == endpoint_id)
              .order_by(alias.id.desc()).limit(1).offset(keep - 1))
    model.delete().where((model.endpoint == endpoint_id) & (model.id < cutoff)).execute()


def _write_stats(hits: list[StatHit], now: datetime) -> None:
    # Aggregate in Python first: PostgreSQL refuses an upsert that touches
    # the same row twice in one statement, and fewer rows are cheaper anyway.
    bins = len(LATENCY_BOUNDS_MS) + 1
    buckets: dict[tuple[int, str, datetime, int], list[float]] = {}
    ips: dict[tuple[int, datetime, str], int] = defaultdict(int)
    for hit in hits:
        for gran in (MINUTE, HOUR):
            key = (hit.endpoint_id, gran, _bucket(hit.time, gran), int(hit.status))
            acc = buckets.setdefault(key, [0.0] * (2 + bins))
            acc[0] += 1
            acc[1] += float(hit.duration_ms)
            acc[2 + latency_bin(hit.duration_ms)] += 1
        ips[(hit.endpoint_id, _bucket(hit.time, HOUR), hit.ip[:45])] += 1
    hist = histogram_fields()
    rows = []
    for (endpoint_id, gran, start, status), acc in sorted(buckets.items()):
        row: dict[str, Any] = {"endpoint": endpoint_id, "granularity": gran, "start": start,
                               "status": status, "count": int(acc[0]), "duration_sum": acc[1]}
        for i, f in enumerate(hist):
            row[f.name] = int(acc[2 + i])
        rows.append(row)
    update: dict[Any, Any] = {StatBucket.count: StatBucket.count + EXCLUDED.count,
                              StatBucket.duration_sum: StatBucket.duration_sum + EXCLUDED.duration_sum}
    for f in hist:
        update[f] = f + getattr(EXCLUDED, f.column_name)
    (StatBucket.insert_many(rows)
     .on_conflict(conflict_target=[StatBucket.endpoint, StatBucket.granularity,
                                   StatBucket.start, StatBucket.status], update=update)
     .execute())
    ip_rows = [{"endpoint": e, "start": s, "ip": ip, "count": n}
               for (e, s, ip), n in sorted(ips.items())]
    (StatIp.insert_many(ip_rows)
     .on_conflict(conflict_target=[StatIp.endpoint, StatIp.start, StatIp.ip],
                  update={StatIp.count: StatIp.count + EXCLUDED.count})
     .execute())
    touched = sorted({h.endpoint_id for h in hits})
    StatBucket.delete().where(StatBucket.endpoint.in_(touched) & (
        ((StatBucket.granularity == MINUTE) & (StatBucket.start < now - MINUTE_RETENTION))
        | ((StatBucket.granularity == HOUR) & (StatBucket.start < now - HOUR_RETENTION)))).execute()
    StatIp.delete().where(StatIp.endpoint.in_(touched)
                          & (StatIp.start < now - IP_RETENTION)).execute()


def write_batch(items: Sequence[Item]) -> None:
    """Append a batch of records and statistics in one transaction (see the
    module docstring).  Raises peewee database errors (the writer retries)."""
    if not items:
        return
    now = utcnow()
    wanted = {i.endpoint_id for i in items}
    with database.atomic():
        existing = {e.id for e in Endpoint.select(Endpoint.id).where(Endpoint.id.in_(sorted(wanted)))}
        requests = [i for i in items if isinstance(i, RequestRecordIn) and i.endpoint_id in existing]
        errors = [i for i in items if isinstance(i, ErrorRecordIn) and i.endpoint_id in existing]
        hits = [i for i in items if isinstance(i, StatHit) and i.endpoint_id in existing]
        if requests:
            RequestRecord.insert_many([_request_row(r) for r in requests]).execute()
            keep: dict[int, int] = {}
            for r in requests:        # the newest item carries the current plan
                keep[r.endpoint_id] = r.keep
            for endpoint_id, n in sorted(keep.items()):
                _prune(RequestRecord, endpoint_id, n)
        if errors:
            ErrorRecord.insert_many([{
                "endpoint": e.endpoint_id, "request_id": e.request_id[:64], "time": to_db(e.time),
                "kind": e.kind[:32], "message": cap_text(e.message, TEXT_CAP) or "",
                "line": e.line, "traceback": cap_text(e.traceback, OUTPUT_CAP),
            } for e in errors]).execute()
            for endpoint_id in sorted({e.endpoint_id for e in errors}):
                _prune(ErrorRecord, endpoint_id, ERROR_KEEP)
        if hits:
            _write_stats(hits, now)


__all__ = ["ErrorRecordIn", "Item", "RequestRecordIn", "StatHit", "write_batch",
           "redact_headers", "cap_body", "BODY_CAP", "ERROR_KEEP", "SECRET_HEADERS"]
