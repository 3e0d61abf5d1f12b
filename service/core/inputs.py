"""Shapes of user input that several rules read: numbers typed as text, and times.

`str.isdigit()` is true for "²" (which `int()` then refuses) and for "١"
(Arabic-Indic one, which `int()` reads as 1), so a number a user sends is
checked here as ASCII digits before it is converted: anything else is bad
input, never a crash and never another id.

A time a user gives may lie outside what a naive UTC datetime can hold
(`0001-01-01T00:00:00+14:00` is before year 1 in UTC): converting it raises
`ValidationError` with the caller's code, never `OverflowError`.
"""
from __future__ import annotations

from datetime import datetime

from models.clock import to_db
from service.core.errors import ValidationError


def ascii_digits(text: str, max_len: int = 18) -> bool:
    """True if `text` is 1 to `max_len` ASCII digits (what `int()` may then read)."""
    return 0 < len(text) <= max_len and text.isascii() and text.isdigit()


def stored_request_id(value: object) -> str | None:
    """`value` as a request id records may hold (printable ASCII, 1 to 64
    characters), else None: no record has any other, and one that is not
    ASCII (a surrogate from the command line) must not reach the database
    driver or an error message."""
    text = str(value)
    return text if 0 < len(text) <= 64 and text.isascii() and text.isprintable() else None


def user_time(value: datetime, *, field: str, code: str) -> datetime:
    """A user's time as the database stores it (naive UTC; naive input is
    UTC already).  Raises `ValidationError` (`code`) when it is out of range."""
    try:
        return to_db(value)
    except (OverflowError, ValueError):
        raise ValidationError(f"{field} is out of range (years 1 to 9999 in UTC)",
                              code=code) from None


__all__ = ["ascii_digits", "user_time"]
