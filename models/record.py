"""Request and error records: the last N per endpoint, appended by the writer.

Both are read as "the newest N of one endpoint", hence the (endpoint, id)
indexes; ids grow with insertion, so id order is arrival order.
"""
from __future__ import annotations

from peewee import (BigAutoField, BooleanField, CharField, DateTimeField, FloatField,
                    ForeignKeyField, IntegerField, SmallIntegerField, TextField)

from models.db import BaseModel
from models.script import Endpoint


class RequestRecord(BaseModel):
    """One request as history shows it; secret headers removed, bodies capped."""

    id = BigAutoField()
    endpoint = ForeignKeyField(Endpoint, on_delete="CASCADE", index=False)
    request_id = CharField(max_length=64)
    time = DateTimeField()
    method = CharField(max_length=16)
    query = TextField(default="{}")
    headers = TextField(default="{}")
    body = TextField(default="")
    body_encoding = CharField(max_length=8, default="text")   # text | base64
    body_truncated = BooleanField(default=False)
    ip = CharField(max_length=45)
    user_agent = TextField(default="")
    status = SmallIntegerField()
    response_headers = TextField(default="{}")
    response_body = TextField(default="")
    response_body_encoding = CharField(max_length=8, default="text")
    response_body_truncated = BooleanField(default=False)
    duration_ms = FloatField()
    output = TextField(default="")
    error = TextField(null=True)
    test = BooleanField(default=False)        # a test call or replay from the admin API
    script_version = IntegerField(null=True)   # the version that ran

    class Meta:
        indexes = ((("endpoint", "id"), False),)


class ErrorRecord(BaseModel):
    """One script failure: kind, message, author's line, script-only traceback."""

    id = BigAutoField()
    endpoint = ForeignKeyField(Endpoint, on_delete="CASCADE", index=False)
    request_id = CharField(max_length=64)
    time = DateTimeField()
    kind = CharField(max_length=32)
    message = TextField()
    line = IntegerField(null=True)
    traceback = TextField(null=True)
    script_version = IntegerField(null=True)   # the version that ran

    class Meta:
        indexes = ((("endpoint", "id"), False),)
