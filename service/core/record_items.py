"""What the record store is given, and the cleaning that makes it storable.

`RequestRecordIn` (history), `ErrorRecordIn` (error log) and `StatHit`
(statistics) are what `service.core.records.write_batch` takes. The helpers
below make their text fit both databases' columns: secret headers dropped,
bodies and output capped with a flag, NUL and lone surrogates replaced.
"""
from __future__ import annotations

import base64
import json
import math
from dataclasses import KW_ONLY, dataclass
from datetime import datetime
from typing import Any, Iterable, Union

BODY_CAP = 8192
OUTPUT_CAP = 8192
TEXT_CAP = 2048
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
    test: bool = False        # a test call or replay from the admin API
    script_version: int | None = None    # the version that ran


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
    script_version: int | None = None    # the version that ran


@dataclass(frozen=True)
class StatHit:
    """One request outcome for the statistics (every outcome counts)."""

    endpoint_id: int
    time: datetime
    status: int
    duration_ms: float
    ip: str
    # Flags by name only: positional booleans were once passed to the wrong one.
    _: KW_ONLY
    queued: bool = False          # waited in the sandbox queue
    deprioritised: bool = False   # ... while its guild was over its worker-time budget
    test: bool = False            # a test call or replay: counted, and counted as a test


Item = Union[RequestRecordIn, ErrorRecordIn, StatHit]


# ------------------------------------------------------------- sanitising
def redact_headers(headers: dict[str, Any] | Iterable[tuple[str, Any]]) -> dict[str, str]:
    """Lower-cased headers without the secret ones."""
    pairs = headers.items() if isinstance(headers, dict) else headers
    return {clean_text(str(k).lower()): clean_text(str(v))
            for k, v in pairs if str(k).lower() not in SECRET_HEADERS}


def joined_headers(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Answer headers as history keeps them: lower-case names, a name sent
    twice kept once with its values joined by ", " (RFC 9110 5.3), as for the
    request's headers (the last value alone was kept before: review, session 25)."""
    out: dict[str, str] = {}
    for name, value in pairs:
        key = name.lower()
        out[key] = f"{out[key]}, {value}" if key in out else value
    return out


def clean_text(text: str) -> str:
    """Text both databases accept: PostgreSQL refuses NUL in text columns and
    neither driver can encode lone surrogates; one bad row would otherwise
    fail the whole batch."""
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text


def cap_body(body: bytes | str | None, cap: int = BODY_CAP) -> tuple[str, str, bool]:
    """Return (stored text, encoding "text" | "base64", truncated).  Binary
    bodies, and text with NUL characters, are stored as base64."""
    if body is None:
        return "", "text", False
    raw = body.encode("utf-8", "replace") if isinstance(body, str) else bytes(body)
    truncated = len(raw) > cap
    raw = raw[:cap]
    # A cut may split a UTF-8 sequence: drop up to 3 trailing bytes before
    # deciding that the body is binary.
    for trim in range(0, 4 if truncated else 1):
        try:
            text = raw[: len(raw) - trim].decode("utf-8")
        except UnicodeDecodeError:
            continue
        if "\x00" not in text:
            return text, "text", truncated
        break
    return base64.b64encode(raw).decode("ascii"), "base64", truncated


def cap_text(text: str | None, cap: int) -> str | None:
    """Cap a text field, marking the cut; cleaned for the database."""
    if text is None:
        return None
    if len(text) > cap:
        text = text[:cap] + _CUT
    return clean_text(text)


def short_text(text: str | None, n: int) -> str:
    """A short column (IDs, method, IP): cleaned, then cut to fit."""
    return clean_text(text or "")[:n]


def json_text(value: Any, cap: int = BODY_CAP) -> str:
    """JSON that stays valid when it is too big to store (a slice would not)."""
    text = json.dumps(value, default=str)
    if len(text) > cap:
        text = json.dumps({"…": f"not stored: {len(text)} bytes of JSON"})
    return text


def storable_ms(value: float) -> float:
    """A duration the databases accept (SQLite stores NaN as NULL)."""
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else 0.0
