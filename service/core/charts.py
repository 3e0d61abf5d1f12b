"""Chart series for the dashboard: requests per time slot, by status class.

The series are advanced statistics: only plans with `advanced_stats` get
them, as the admin API's `/stats` gives `perMinute` and `perHour` only to
those plans (`service.core.reads.stats`, which also holds the percentiles and
top IPs).
Slots without requests are present with zero counts, so a chart has a fixed
width: the last 60 minutes, and the last 30 days by hour.
"""
from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Iterable, Mapping, cast

from models import Endpoint, StatBucket
from models.clock import iso, utcnow
from models.stats import HOUR, MINUTE
from service.core.access import Actor, guild_and_script
from service.core.errors import QuotaError
from service.plans import DEFAULT_PLANS, Plan, resolve_plan

CLASSES = ("2xx", "3xx", "4xx", "5xx")


def status_class(status: int) -> str:
    """`"2xx"` for 200..299 and so on (1xx counts as 2xx: the service never sends it)."""
    return f"{max(2, min(5, status // 100))}xx"


def _slots(endpoint_id: int, granularity: str, start: datetime, step: timedelta,
           count: int) -> list[dict[str, Any]]:
    points: list[dict[str, Any]] = [{"time": iso(start + i * step), **{c: 0 for c in CLASSES}}
                                    for i in range(count)]
    rows = cast(Iterable[tuple[datetime, int, int]], (
        StatBucket.select(StatBucket.start, StatBucket.status, StatBucket.count)
        .where((StatBucket.endpoint == endpoint_id) & (StatBucket.granularity == granularity)
               & (StatBucket.start >= start) & (StatBucket.start < start + count * step))
        .tuples()))
    for when, status, n in rows:
        index = int((when - start) / step)
        if 0 <= index < count:
            points[index][status_class(int(status))] += int(n)
    return points


def request_series(actor: Actor, guild_id: str, script_id: str, *,
                   plans: Mapping[str, Plan] = DEFAULT_PLANS,
                   now: datetime | None = None) -> dict[str, Any]:
    """`{"perMinute": 60 slots, "perHour": 720 slots}`, each slot
    `{"time", "2xx", "3xx", "4xx", "5xx"}`, oldest first.  Who may read:
    owner, managers, operator.  Raises `NotFoundError`, `PermissionDeniedError`,
    `QuotaError` (`plan_feature`: the plan has no advanced statistics)."""
    guild, script, _ = guild_and_script(actor, guild_id, script_id, "read statistics")
    plan = resolve_plan(plans, guild.plan)
    if not plan.advanced_stats:
        raise QuotaError(f"plan {plan.name} does not include advanced statistics",
                         code="plan_feature")
    endpoint = Endpoint.get(Endpoint.script == script.id)
    now = now or utcnow()
    minute = now.replace(second=0, microsecond=0)
    hour = now.replace(minute=0, second=0, microsecond=0)
    return {
        "perMinute": _slots(endpoint.id, MINUTE, minute - timedelta(minutes=59),
                            timedelta(minutes=1), 60),
        "perHour": _slots(endpoint.id, HOUR, hour - timedelta(hours=30 * 24 - 1),
                          timedelta(hours=1), 30 * 24),
    }
