"""Save-time checks on script source, for every front: compile, then `sandbox.checks`.

Both run in the sandboxed save-time compile process (`sandbox.compile_gate`);
the functions below run the checks in this process, for a build without it.

`refuse_errors(text)` raises the same `CompileError` (`compile_error`,
`"script does not compile: LINE:COL: message; ..."`) as a syntax error, so a
front shows a refused import exactly like a typo.  `warnings_of(text)` gives
the findings that do not refuse the save; scripts store them.  `check_source`
runs both without saving anything (`logic script check FILE`).
"""
from __future__ import annotations

import json
from typing import Any

from sandbox.checks import check_source as _check
from service.core.errors import CompileError


def _line(f: Any) -> str:
    return f"{f.line}:{f.column}: {f.message}"


def refuse_errors(text: str) -> None:
    """Raise `CompileError` (`compile_error`, every error's line, column and
    message) when a check finds an error."""
    report = _check(text)
    if report.errors:
        raise CompileError("script does not compile: " + "; ".join(_line(e) for e in report.errors),
                           [{"line": e.line, "column": e.column, "message": e.message}
                            for e in report.errors])


def warnings_of(text: str) -> list[dict[str, Any]]:
    """The warnings of `text` as `[{"line", "column", "message"}]`."""
    return [{"line": w.line, "column": w.column, "message": w.message} for w in _check(text).warnings]


def stored_warnings(raw: str | None) -> list[dict[str, Any]]:
    """The warnings column as a list (NULL: none, or saved before checks were kept)."""
    return list(json.loads(raw)) if raw else []


def check_source(source: str | bytes) -> dict[str, Any]:
    """`{"ok": true, "warnings": [...]}` for a source that would be accepted.
    Raises `ValidationError` exactly as saving it would."""
    from service.core.scripts import checked_source    # scripts imports this module
    return {"ok": True, "warnings": checked_source(source)[1]}
