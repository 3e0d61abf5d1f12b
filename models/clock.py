"""Time as the database stores it: naive UTC datetimes (portable across
SQLite and PostgreSQL `timestamp without time zone`)."""
from __future__ import annotations

from datetime import datetime, timezone


def utcnow() -> datetime:
    """Now, naive UTC."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


def to_db(value: datetime) -> datetime:
    """Any datetime to naive UTC (naive input is taken as UTC already)."""
    if value.tzinfo is not None:
        value = value.astimezone(timezone.utc).replace(tzinfo=None)
    return value


def iso(value: datetime | None) -> str | None:
    """Naive-UTC datetime to ISO 8601 with milliseconds and a Z."""
    if value is None:
        return None
    return to_db(value).isoformat(timespec="milliseconds") + "Z"
