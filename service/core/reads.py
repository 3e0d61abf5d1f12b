"""Reads for script authors: request history, error log, statistics.

Shapes are the CLI's `--json` ones (docs/operations.md documents the stats
fields).  Who may read: owner, managers, operator.  The error log needs a
plan with error logs; the advanced statistics (percentiles, series, top IPs)
need a plan with advanced statistics.
"""
from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any, Iterable, Mapping, cast

from peewee import fn as _fn

from models import Endpoint, ErrorRecord, RequestRecord, StatBucket, StatIp, StatSketch
from models.clock import iso, utcnow
from models.stats import HOUR, LATENCY_BOUNDS_MS, MINUTE, histogram_fields
from service.core.access import Actor, guild_and_script
from service.core.errors import QuotaError
from service.core.records import ERROR_KEEP, OTHER_CALLERS
from service.core.sketch import RELATIVE_ERROR, quantiles
from service.plans import DEFAULT_PLANS, Plan, resolve_plan

TOP_IPS = 10
# peewee's `fn` is untyped in its stubs: one typed alias instead of ignores.
fn: Any = _fn


def _endpoint_and_plan(actor: Actor, guild_id: str, script_id: str, what: str,
                       plans: Mapping[str, Plan]) -> tuple[Endpoint, Plan]:
    guild, script, _ = guild_and_script(actor, guild_id, script_id, what)
    return Endpoint.get(Endpoint.script == script.id), resolve_plan(plans, guild.plan)


def in_history(endpoint_id: int, keep: int) -> Any:
    """The condition on `RequestRecord` rows that are the endpoint's history:
    its newest `keep` (`keep` > 0).  Rows past them are invisible everywhere
    (lists, one record, replays) until a write prunes them: the writer prunes
    an endpoint only once it may have grown `prune_slack` past its plan, and a
    downgrade leaves the older rows until the next write."""
    newest = (RequestRecord.select(RequestRecord.id).where(RequestRecord.endpoint == endpoint_id)
              .order_by(RequestRecord.id.desc()).limit(1).offset(keep - 1))
    # COALESCE: fewer rows than the plan keeps means "from the first one".
    return (RequestRecord.endpoint == endpoint_id) & (RequestRecord.id >= fn.COALESCE(newest, 0))


def history(actor: Actor, guild_id: str, script_id: str, *,
            plans: Mapping[str, Plan] = DEFAULT_PLANS) -> dict[str, Any]:
    """`{"records": [...]}` newest first.  Raises `NotFoundError`, `PermissionDeniedError`."""
    endpoint, plan = _endpoint_and_plan(actor, guild_id, script_id, "read history", plans)
    if plan.history <= 0:
        return {"records": []}
    # Limit as well as prune: rows past the plan's newest N stay until a
    # write prunes them (after a downgrade, or within the writer's slack).
    rows = (RequestRecord.select().where(RequestRecord.endpoint == endpoint.id)
            .order_by(RequestRecord.id.desc()).limit(plan.history))
    return {"records": [record_view(r) for r in rows]}


def record_view(r: RequestRecord) -> dict[str, Any]:
    """The JSON shape of one request record (history)."""
    return {
        "id": r.id, "requestId": r.request_id, "time": iso(r.time), "method": r.method,
        "status": r.status, "ip": r.ip, "userAgent": r.user_agent,
        "query": json.loads(r.query), "headers": json.loads(r.headers),
        "body": r.body, "bodyEncoding": r.body_encoding, "bodyTruncated": bool(r.body_truncated),
        "responseHeaders": json.loads(r.response_headers), "responseBody": r.response_body,
        "responseBodyEncoding": r.response_body_encoding,
        "responseBodyTruncated": bool(r.response_body_truncated),
        "durationMs": r.duration_ms, "output": r.output, "error": r.error, "test": bool(r.test),
        "scriptVersion": r.script_version,   # the version that ran (null before versions)
    }


def error_view(r: ErrorRecord) -> dict[str, Any]:
    """The JSON shape of one error record."""
    return {"id": r.id, "time": iso(r.time), "requestId": r.request_id, "kind": r.kind,
            "message": r.message, "line": r.line, "traceback": r.traceback,
            "scriptVersion": r.script_version}


def errors(actor: Actor, guild_id: str, script_id: str, *,
           plans: Mapping[str, Plan] = DEFAULT_PLANS) -> dict[str, Any]:
    """`{"errors": [...]}` newest first.  Raises `QuotaError` (`plan_feature`)
    on plans without error logs, `NotFoundError`, `PermissionDeniedError`."""
    endpoint, plan = _endpoint_and_plan(actor, guild_id, script_id, "read error logs", plans)
    if not plan.error_logs:
        raise QuotaError(f"plan {plan.name} does not include error logs", code="plan_feature")
    rows = (ErrorRecord.select().where(ErrorRecord.endpoint == endpoint.id)
            .order_by(ErrorRecord.id.desc()).limit(ERROR_KEEP))
    return {"errors": [error_view(r) for r in rows]}


def _series(endpoint_id: int, granularity: str, since: datetime) -> list[dict[str, Any]]:
    rows = (StatBucket.select(StatBucket.start, StatBucket.status, StatBucket.count,
                              StatBucket.duration_sum)
            .where((StatBucket.endpoint == endpoint_id) & (StatBucket.granularity == granularity)
                   & (StatBucket.start >= since))
            .order_by(StatBucket.start, StatBucket.status))
    points: dict[datetime, dict[str, Any]] = {}
    for r in rows:
        point = points.setdefault(r.start, {"time": iso(r.start), "total": 0, "byStatus": {},
                                            "durationSum": 0.0})
        point["total"] += r.count
        point["byStatus"][str(r.status)] = r.count
        point["durationSum"] += r.duration_sum
    out = []
    for point in points.values():
        point["avgMs"] = round(point.pop("durationSum") / point["total"], 3) if point["total"] else None
        out.append(point)
    return out


def hour_floor(t: datetime) -> datetime:
    return t.replace(minute=0, second=0, microsecond=0)


def stats(actor: Actor, guild_id: str, script_id: str, *,
          plans: Mapping[str, Plan] = DEFAULT_PLANS, now: datetime | None = None) -> dict[str, Any]:
    """Counters over the last 30 days: `{"total", "byStatus", "testCalls", "last24h",
    "avgMs", "scheduling": {"queued", "busy", "deprioritised"}}`, plus on plans
    with advanced statistics `latency` (p50/p90/p99 over 24 h from the latency
    sketch, within `relativeError` of the recorded durations; the coarse
    histogram for charts), `perMinute` (24 h), `perHour` (30 days) and `topIps`.
    Raises `NotFoundError`, `PermissionDeniedError`."""
    endpoint, plan = _endpoint_and_plan(actor, guild_id, script_id, "read statistics", plans)
    now = now or utcnow()
    month, day = now - timedelta(days=30), now - timedelta(hours=24)
    by_status: dict[str, int] = {}
    total, duration, queued, deprioritised = 0, 0.0, 0, 0
    tests = 0
    for status, count, dsum, tcount, q, d in cast(Iterable[tuple[Any, ...]], (
            StatBucket.select(StatBucket.status, fn.SUM(StatBucket.count),
                              fn.SUM(StatBucket.duration_sum), fn.SUM(StatBucket.test_count),
                              fn.SUM(StatBucket.queued), fn.SUM(StatBucket.deprioritised))
            .where((StatBucket.endpoint == endpoint.id) & (StatBucket.granularity == HOUR)
                   & (StatBucket.start >= hour_floor(month)))
            .group_by(StatBucket.status).order_by(StatBucket.status).tuples())):
        by_status[str(status)] = int(count)
        total += int(count)
        tests += int(tcount or 0)
        duration += float(dsum or 0)
        queued += int(q or 0)
        deprioritised += int(d or 0)
    last24 = (StatBucket.select(fn.COALESCE(fn.SUM(StatBucket.count), 0))
              .where((StatBucket.endpoint == endpoint.id) & (StatBucket.granularity == MINUTE)
                     & (StatBucket.start >= day)).scalar())
    # `total` and `byStatus` count test calls too (they ran); `testCalls` says how many.
    result: dict[str, Any] = {"total": total, "byStatus": by_status, "testCalls": tests,
                              "last24h": int(last24 or 0),
                              "avgMs": round(duration / total, 3) if total else None,
                              "window": "30d", "advanced": plan.advanced_stats,
                              # Sandbox scheduling: requests that waited for a worker,
                              # were refused 503 busy, or waited while the guild was
                              # deprioritised (over its worker-time budget).
                              "scheduling": {"queued": queued, "busy": by_status.get("503", 0),
                                             "deprioritised": deprioritised}}
    if not plan.advanced_stats:
        return result
    hist = histogram_fields()
    sums = (StatBucket.select(*[fn.COALESCE(fn.SUM(f), 0) for f in hist])
            .where((StatBucket.endpoint == endpoint.id) & (StatBucket.granularity == MINUTE)
                   & (StatBucket.start >= day)).tuples().first())
    histogram = [int(v or 0) for v in (sums or [0] * len(hist))]
    sketch = cast(Iterable[tuple[int, int]], (
        StatSketch.select(StatSketch.key, fn.SUM(StatSketch.count))
        .where((StatSketch.endpoint == endpoint.id) & (StatSketch.start >= day))
        .group_by(StatSketch.key).tuples()))
    counts = [(int(k), int(n)) for k, n in sketch]
    p50, p90, p99 = quantiles(counts, (0.50, 0.90, 0.99))
    result["latency"] = {"window": "24h", "p50": p50, "p90": p90, "p99": p99,
                         "count": sum(n for _, n in counts), "relativeError": RELATIVE_ERROR,
                         "histogram": {"boundsMs": list(LATENCY_BOUNDS_MS), "counts": histogram}}
    result["perMinute"] = _series(endpoint.id, MINUTE, day)
    result["perHour"] = _series(endpoint.id, HOUR, hour_floor(month))
    top = cast(Iterable[tuple[Any, ...]], StatIp.select(StatIp.ip, fn.SUM(StatIp.count).alias("n"))
           .where((StatIp.endpoint == endpoint.id) & (StatIp.start >= hour_floor(month))
                  & (StatIp.ip != OTHER_CALLERS))
           .group_by(StatIp.ip).order_by(fn.SUM(StatIp.count).desc(), StatIp.ip)
           .limit(TOP_IPS).tuples())
    result["topIps"] = [{"ip": ip, "count": int(n)} for ip, n in top]
    return result
