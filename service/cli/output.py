"""How the CLI shows things to people: aligned tables, local times, short durations, colour.

Colour comes from click's styling, and `click.echo` drops it when stdout is
not a terminal (a pipe, a file, a test), so output meant for people is
plain text whenever it is not read on a terminal.  `--json` output never
comes through here.
"""
from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Any, Sequence

import click

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: Characters a terminal acts on instead of showing: C0 controls but newline
#: and tab, DEL, C1 controls, and the bidirectional overrides that reorder
#: what is shown.
_UNPRINTABLE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value: Any) -> Any:
    """`value` with every string's control characters shown as `\\xNN`.

    Records hold what callers sent and what scripts printed, raised and
    replied: an escape sequence among them would, on the operator's terminal,
    retitle the window, move the cursor over earlier lines or write the
    clipboard. Newlines and tabs stay (bodies and tracebacks are shown as
    lines). Dicts and lists are copied with their strings escaped."""
    if isinstance(value, str):
        return _UNPRINTABLE.sub(_escaped, value)
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [printable(v) for v in value]
    return value


def local_time(value: str | None) -> str:
    """An ISO 8601 UTC time (`...Z`) as local time, to the second."""
    if not value:
        return "-"
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return value
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def duration(ms: float | None) -> str:
    """Milliseconds rounded to 0.1 ms, with the unit."""
    return "-" if ms is None else f"{ms:.1f} ms"


def status_colour(status: int | str) -> str:
    """The status, green / yellow / red by class (plain off a terminal)."""
    text = str(status)
    colour = {"2": "green", "3": "cyan", "4": "yellow", "5": "red"}.get(text[:1])
    return click.style(text, fg=colour) if colour else text


def _width(text: str) -> int:
    return len(_ANSI.sub("", text))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], empty: str = "(none)") -> str:
    """Rows under a bold header, each column padded to its widest cell."""
    if not rows:
        return empty
    # A cell is one line: a newline in what a script wrote would start a row.
    cells = [[("-" if v is None else one_line(str(v))) for v in row] for row in rows]
    widths = [max([len(h)] + [_width(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        padded = [v + " " * (widths[i] - _width(v)) for i, v in enumerate(values)]
        return "  ".join(padded).rstrip()

    head = line([click.style(h, bold=True) for h in headers])
    return "\n".join([head, *(line(r) for r in cells)])


def fields(pairs: Sequence[tuple[str, Any]]) -> str:
    """`label  value` lines, labels aligned."""
    width = max((len(k) for k, _ in pairs), default=0)
    return "\n".join(f"{k.ljust(width)}  {'-' if v is None else one_line(str(v))}"
                     for k, v in pairs)


def one_line(text: str) -> str:
    """`text` on one line: newlines shown as `\\n` (a field or a table cell)."""
    return text.replace("\n", "\\n")


_RELATIVE = re.compile(r"^([0-9]{1,9})\s*([smhd])$")


def parse_since(text: str | None) -> datetime | None:
    """`--since`: `30m`, `2h`, `7d` ago, or an ISO 8601 date/time (local
    when it has no zone).  Raises `click.BadParameter`."""
    if text is None:
        return None
    match = _RELATIVE.match(text.strip().lower())
    try:
        if match:
            n, unit = int(match.group(1)), match.group(2)
            delta = {"s": timedelta(seconds=n), "m": timedelta(minutes=n),
                     "h": timedelta(hours=n), "d": timedelta(days=n)}[unit]
            return datetime.now(timezone.utc) - delta
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
        return when if when.tzinfo is not None else when.astimezone()
    except (ValueError, OverflowError):
        raise click.BadParameter(f"{text!r}: use 30m, 2h, 7d or a date such as 2026-01-31T12:00"
                                 " (years 1 to 9999)", param_hint="--since") from None


def warn(message: str) -> None:
    """One warning line on stderr."""
    click.echo(click.style("logic: warning: ", fg="yellow") + message, err=True)
