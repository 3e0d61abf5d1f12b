"""0002: statistics counters (per-minute/per-hour buckets with a latency
histogram, and caller IPs per hour).  Frozen copies; see 0001."""
from __future__ import annotations

from peewee import (AutoField, CharField, Database, DateTimeField, FloatField,
                    ForeignKeyField, IntegerField, Model, SmallIntegerField)


class Endpoint(Model):
    """Stub of the existing table, only so the foreign keys have a target."""

    id = AutoField()

    class Meta:
        table_name = "endpoint"


class StatBucket(Model):
    id = AutoField()
    endpoint = ForeignKeyField(Endpoint, on_delete="CASCADE", index=False)
    granularity = CharField(max_length=1)
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

    class Meta:
        table_name = "stat_bucket"
        indexes = ((("endpoint", "granularity", "start", "status"), True),)


class StatIp(Model):
    id = AutoField()
    endpoint = ForeignKeyField(Endpoint, on_delete="CASCADE", index=False)
    start = DateTimeField()
    ip = CharField(max_length=45)
    count = IntegerField(default=0)

    class Meta:
        table_name = "stat_ip"
        indexes = ((("endpoint", "start", "ip"), True),)


NEW = [StatBucket, StatIp]


def up(db: Database) -> None:
    with db.bind_ctx([Endpoint, *NEW]):
        db.create_tables(NEW, safe=False)


def down(db: Database) -> None:
    with db.bind_ctx([Endpoint, *NEW]):
        db.drop_tables(list(reversed(NEW)), safe=False)
