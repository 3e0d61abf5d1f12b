"""Statistics counters: per endpoint, per time bucket, per status.

Buckets are minutes (kept 24 h) and hours (kept 30 days).  Each row carries a
coarse latency histogram (`h0`..`h11`, upper bounds in `LATENCY_BOUNDS_MS`,
the last bin open-ended) so percentiles need no raw rows.  Caller IPs are
counted per hour in `StatIp` for the "top callers" view.
"""
from __future__ import annotations

from peewee import (AutoField, CharField, DateTimeField, FloatField, ForeignKeyField,
                    IntegerField, SmallIntegerField)

from models.db import BaseModel
from models.script import Endpoint

#: Upper bounds (ms, inclusive) of the latency bins; one more bin holds the rest.
LATENCY_BOUNDS_MS: tuple[float, ...] = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)
HISTOGRAM_BINS = len(LATENCY_BOUNDS_MS) + 1
MINUTE, HOUR = "m", "h"


class StatBucket(BaseModel):
    """Counts for one endpoint, bucket and status."""

    id = AutoField()
    endpoint = ForeignKeyField(Endpoint, on_delete="CASCADE", index=False)
    granularity = CharField(max_length=1)          # MINUTE | HOUR
    start = DateTimeField()
    status = SmallIntegerField()
    count = IntegerField(default=0)
    duration_sum = FloatField(default=0.0)
    h0 = IntegerField(default=0)
    h1 = IntegerField(default=0)
    h2 = IntegerField(default=0)
    h3 = IntegerField(default=0)
    h4 = IntegerField(default=0)
    h5 = IntegerField(default=0)
    h6 = IntegerField(default=0)
    h7 = IntegerField(default=0)
    h8 = IntegerField(default=0)
    h9 = IntegerField(default=0)
    h10 = IntegerField(default=0)
    h11 = IntegerField(default=0)
    test_count = IntegerField(default=0)           # how many of `count` were test calls
    #: Of `count`: requests that waited in the sandbox queue for a worker, and
    #: those that waited while their guild was over its worker-time budget.
    queued = IntegerField(default=0)
    deprioritised = IntegerField(default=0)

    class Meta:
        indexes = ((("endpoint", "granularity", "start", "status"), True),)


class StatIp(BaseModel):
    """Requests per caller IP, per endpoint and hour."""

    id = AutoField()
    endpoint = ForeignKeyField(Endpoint, on_delete="CASCADE", index=False)
    start = DateTimeField()
    ip = CharField(max_length=45)
    count = IntegerField(default=0)

    class Meta:
        indexes = ((("endpoint", "start", "ip"), True),)


def histogram_fields() -> list[IntegerField]:
    """The histogram columns in bin order."""
    return [getattr(StatBucket, f"h{i}") for i in range(HISTOGRAM_BINS)]


class StatSketch(BaseModel):
    """Latency sketch: requests per endpoint, minute and logarithmic key
    (`service.core.sketch`: every key covers durations within 1 % of each other)."""

    id = AutoField()
    endpoint = ForeignKeyField(Endpoint, on_delete="CASCADE", index=False)
    start = DateTimeField()
    key = SmallIntegerField()
    count = IntegerField(default=0)

    class Meta:
        indexes = ((("endpoint", "start", "key"), True),)
