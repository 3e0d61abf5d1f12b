"""Helpers for the script-language tests: compile and run snippets in-process."""
from __future__ import annotations

import textwrap
from typing import Any

from sandbox.compiler import CompiledScript, compile_script
from sandbox.runtime import run_endpoint


def make_event(**overrides: Any) -> dict[str, Any]:
    """A request event as the service builds it (architecture.md)."""
    event: dict[str, Any] = {
        "body": {"score": 21, "name": "ada"},
        "rawBody": '{"score": 21, "name": "ada"}',
        "headers": {"content-type": "application/json", "user-agent": "pytest"},
        "query": {"page": "2", "tag": ["a", "b"]},
        "method": "POST",
        "ip": "203.0.113.7",
        "userAgent": "pytest",
        "timestamp": "2026-11-21T10:00:00.000Z",
    }
    event.update(overrides)
    return event


def compiled(source: str) -> CompiledScript:
    """Compile ``source`` (dedented) and fail the test if it does not compile."""
    result = compile_script(textwrap.dedent(source))
    assert result.ok, result.errors
    assert result.script is not None
    return result.script


def run(source: str, event: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    """Compile and run ``source``; returns run_endpoint's result."""
    return run_endpoint(compiled(source), event if event is not None else make_event(), **kwargs)


def block(body: str, prelude: str = "") -> str:
    """Wrap ``body`` into an ``on endpoint(event):`` block after ``prelude``."""
    inner = textwrap.indent(textwrap.dedent(body).strip("\n"), "    ")
    return textwrap.dedent(prelude) + "on endpoint(event):\n" + inner + "\n"


def run_block(body: str, prelude: str = "", event: dict[str, Any] | None = None,
              **kwargs: Any) -> dict[str, Any]:
    """Run ``body`` as the endpoint block."""
    return run(block(body, prelude), event, **kwargs)


def errors(source: str) -> list[tuple[int, int, str]]:
    """Compile errors of ``source`` (dedented) as (line, column, message)."""
    result = compile_script(textwrap.dedent(source))
    assert not result.ok
    return [(e.line, e.column, e.message) for e in result.errors]


def error_kind(result: dict[str, Any]) -> str | None:
    """The error kind of a run_endpoint result, or None."""
    error = result["error"]
    return None if error is None else error["kind"]


def error_message(result: dict[str, Any]) -> str:
    """The error message of a run_endpoint result (asserts there is one)."""
    assert result["error"] is not None, result
    message: str = result["error"]["message"]
    return message
