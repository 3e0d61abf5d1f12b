"""What one invocation produced, as the service sees it.

An :class:`Outcome` is built in the service process from a validated reply
frame (plain data only), or by the pool itself when the worker never
answered (timeout, crash).  It never holds an object the script made.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NO_REPLY_BODY = b'{"success": true}'
JSON_TYPE = "application/json"

# HTTP status per error kind (DESIGN section 4); ``crash`` surfaces as a
# 500 script_error to the caller, the error log keeps the kind.
ERROR_STATUS: dict[str, int] = {
    "script_error": 500,
    "script_timeout": 504,
    "script_memory_exceeded": 500,
    "invalid_reply": 500,
    "no_endpoint_handler": 501,
    "crash": 500,
}


@dataclass(frozen=True, slots=True)
class Outcome:
    """Status, headers, body and diagnostics of one invocation."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes
    content_type: str
    replied: bool
    output: str
    error_kind: str | None
    error_message: str | None
    error_line: int | None
    traceback: str | None
    duration_ms: float
    peak_memory_bytes: int
    #: The request waited in the pool's queue for a run slot.
    waited: bool = False
    #: It waited while its guild was over its worker-time budget (served last).
    deprioritised: bool = False

    @property
    def ok(self) -> bool:
        """True when the script ran to the end without an error."""
        return self.error_kind is None


def from_result(r: dict[str, Any], duration_ms: float, peak: int, waited: bool = False,
                deprioritised: bool = False) -> Outcome:
    """Map a validated ``run_endpoint`` result (see ``protocol.check_result``)."""
    error = r["error"]
    if error is not None:
        kind = error["kind"]
        return Outcome(
            status=ERROR_STATUS[kind], headers=[], body=b"", content_type="",
            replied=False, output=r["output"], error_kind=kind,
            error_message=error["message"], error_line=error["line"],
            traceback=error["traceback"], duration_ms=duration_ms, peak_memory_bytes=peak,
            waited=waited, deprioritised=deprioritised,
        )
    if not r["replied"]:
        return Outcome(
            status=200, headers=[], body=NO_REPLY_BODY, content_type=JSON_TYPE,
            replied=False, output=r["output"], error_kind=None, error_message=None,
            error_line=None, traceback=None, duration_ms=duration_ms, peak_memory_bytes=peak,
            waited=waited, deprioritised=deprioritised,
        )
    return Outcome(
        status=r["status"], headers=[(n, v) for n, v in r["headers"]], body=r["body"],
        content_type=r["contentType"], replied=True, output=r["output"], error_kind=None,
        error_message=None, error_line=None, traceback=None, duration_ms=duration_ms,
        peak_memory_bytes=peak, waited=waited, deprioritised=deprioritised,
    )


def failure(kind: str, message: str, duration_ms: float, peak: int = 0) -> Outcome:
    """An outcome the pool makes itself (the worker did not answer)."""
    return Outcome(
        status=ERROR_STATUS[kind], headers=[], body=b"", content_type="", replied=False,
        output="", error_kind=kind, error_message=message, error_line=None, traceback=None,
        duration_ms=duration_ms, peak_memory_bytes=peak,
    )
