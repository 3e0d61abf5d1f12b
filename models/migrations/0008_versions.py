"""0008: script versions, save-time warnings, the version each record ran, and
latency sketches for exact-within-1 % percentiles.  Frozen copies; see 0001.

Existing scripts get their current source as their first kept version."""
from __future__ import annotations

from peewee import (AutoField, BigAutoField, CharField, Database, DateTimeField,
                    ForeignKeyField, IntegerField, Model, SmallIntegerField, TextField)
from playhouse.migrate import SchemaMigrator, migrate  # type: ignore[import-untyped]

from models.clock import utcnow


class Script(Model):
    """Stub of the existing table (the foreign key's target, and the backfill)."""

    id = AutoField()
    source = TextField()
    version = IntegerField()

    class Meta:
        table_name = "script"


class Endpoint(Model):
    id = AutoField()

    class Meta:
        table_name = "endpoint"


class ScriptVersion(Model):
    id = BigAutoField()
    script = ForeignKeyField(Script, on_delete="CASCADE", index=False)
    version = IntegerField()
    source = TextField()
    author = CharField(max_length=80)
    created_at = DateTimeField()

    class Meta:
        table_name = "script_version"
        indexes = ((("script", "version"), True),)


class StatSketch(Model):
    id = AutoField()
    endpoint = ForeignKeyField(Endpoint, on_delete="CASCADE", index=False)
    start = DateTimeField()
    key = SmallIntegerField()
    count = IntegerField(default=0)

    class Meta:
        table_name = "stat_sketch"
        indexes = ((("endpoint", "start", "key"), True),)


NEW = [ScriptVersion, StatSketch]


def up(db: Database) -> None:
    migrator = SchemaMigrator.from_database(db)
    migrate(
        migrator.add_column("script", "warnings", TextField(null=True)),
        migrator.add_column("request_record", "script_version", IntegerField(null=True)),
        migrator.add_column("error_record", "script_version", IntegerField(null=True)),
    )
    with db.bind_ctx([Script, Endpoint, *NEW]):
        db.create_tables(NEW, safe=False)
        now = utcnow()
        for script in Script.select(Script.id, Script.source, Script.version):
            ScriptVersion.create(script=script.id, version=script.version, source=script.source,
                                 author="(before versions were kept)", created_at=now)


def down(db: Database) -> None:
    with db.bind_ctx(NEW):
        db.drop_tables(list(reversed(NEW)), safe=False)
    migrator = SchemaMigrator.from_database(db)
    migrate(
        migrator.drop_column("error_record", "script_version"),
        migrator.drop_column("request_record", "script_version"),
        migrator.drop_column("script", "warnings"),
    )
