"""`logic history`, `logic errors`, `logic stats`: what an endpoint's callers did.

People get tables (`service.cli.output`); `--json` gives the records as the
service layer returns them.
"""
from __future__ import annotations

from typing import Any, Sequence

import click

from service.cli.base import core, State, actor_of, as_option, cli, emit, json_option, pass_state, run_core, WholeNumber
from service.cli.output import (duration, fields, local_time, one_line, parse_since,
                                status_colour, table)

_filters = [
    click.option("--limit", type=WholeNumber(1, 1000), default=None, help="Show at most N records, 1-1000."),
    click.option("--status", "status", metavar="2xx|4xx|5xx|CODE", default=None,
                 help="Only this status class (2xx, 4xx, 5xx) or code."),
    click.option("--since", metavar="WHEN", default=None,
                 help="Only records at or after WHEN: 30m, 2h, 7d or an ISO date/time."),
]


def _with_filters(func: Any) -> Any:
    for option in reversed(_filters):
        func = option(func)
    return func


class _ListOrShow(click.Group):
    """`history GUILD SCRIPT` lists; `history show GUILD SCRIPT REQUEST_ID` shows one."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["list", *args]
        return super().parse_args(ctx, args)


@cli.group(cls=_ListOrShow)
def history() -> None:
    """Request history, newest first: `history GUILD_ID SCRIPT_ID [--limit N]
    [--status 2xx|4xx|5xx|CODE] [--since 30m|2h|7d|DATE] [--as U] [--json]`, or one
    record in full: `history show GUILD_ID SCRIPT_ID REQUEST_ID`."""


def _history_text(data: dict[str, Any]) -> str:
    rows = [(local_time(r["time"]), r["requestId"], r["method"], status_colour(r["status"]),
             duration(r["durationMs"]), r["ip"], r.get("scriptVersion"), r["error"] or "")
            for r in data["records"]]
    return table(("TIME", "REQUEST ID", "METHOD", "STATUS", "DURATION", "IP", "VERSION", "ERROR"),
                 rows, empty="(no requests recorded)")


@history.command("list")
@click.argument("guild_id")
@click.argument("script_id")
@_with_filters
@as_option
@json_option
@pass_state
def history_list(state: State, guild_id: str, script_id: str, limit: int | None,
                 status: str | None, since: str | None, as_user: str | None, as_json: bool) -> None:
    """Show the request history, newest first."""
    when = parse_since(since)
    emit(run_core(state, lambda: core.history_page(
        actor_of(as_user), guild_id, script_id, plans=state.settings.plans, limit=limit,
        status=status, since=when)), as_json, _history_text)


def _block(title: str, text: str | None) -> list[str]:
    if not text:
        return [f"{title}: -"]
    return [f"{title}:", *("  " + line for line in text.splitlines())]


def _record_text(r: dict[str, Any]) -> str:
    head = fields([
        ("request", r["requestId"]), ("time", local_time(r["time"])),
        ("method", r["method"]), ("status", status_colour(r["status"])),
        ("duration", duration(r["durationMs"])), ("ip", r["ip"]),
        ("user agent", r["userAgent"] or "-"), ("script version", r.get("scriptVersion")),
        ("query", r["query"] or "-"), ("error", r["error"] or "-")])
    lines = [head]
    lines += _block("request headers", "\n".join(f"{k}: {v}" for k, v in r["headers"].items()))
    lines += _block("request body" + (" (base64)" if r["bodyEncoding"] == "base64" else "")
                    + (" (truncated)" if r["bodyTruncated"] else ""), r["body"])
    lines += _block("response headers",
                    "\n".join(f"{k}: {v}" for k, v in r["responseHeaders"].items()))
    lines += _block("response body" + (" (base64)" if r["responseBodyEncoding"] == "base64" else "")
                    + (" (truncated)" if r["responseBodyTruncated"] else ""), r["responseBody"])
    lines += _block("output", r["output"])
    error = r.get("errorRecord")
    if error:
        where = f" at line {error['line']}" if error["line"] else ""
        lines.append(f"error record: {error['kind']}{where}: {one_line(error['message'])}")
        lines += _block("traceback", error["traceback"])
    return "\n".join(lines)


@history.command("show")
@click.argument("guild_id")
@click.argument("script_id")
@click.argument("request_id")
@as_option
@json_option
@pass_state
def history_show(state: State, guild_id: str, script_id: str, request_id: str,
                 as_user: str | None, as_json: bool) -> None:
    """Show one request record in full (headers, bodies, output, error)."""
    emit(run_core(state, lambda: core.history_record(
        actor_of(as_user), guild_id, script_id, request_id, plans=state.settings.plans)),
        as_json, _record_text)


def _errors_text(data: dict[str, Any]) -> str:
    if not data["errors"]:
        return "(no errors recorded)"
    lines = table(("TIME", "REQUEST ID", "KIND", "LINE", "VERSION"),
                  [(local_time(e["time"]), e["requestId"], click.style(e["kind"], fg="red"),
                    e["line"], e.get("scriptVersion")) for e in data["errors"]]).split("\n")
    out = [lines[0]]
    for row, e in zip(lines[1:], data["errors"]):   # each row, then its message and traceback
        out += [row, *("    " + line for line in (e["message"] or "").splitlines())]
        out += ["    " + line for line in (e["traceback"] or "").splitlines()]
    return "\n".join(out)


@cli.command("errors")
@click.argument("guild_id")
@click.argument("script_id")
@_with_filters
@as_option
@json_option
@pass_state
def errors(state: State, guild_id: str, script_id: str, limit: int | None, status: str | None,
           since: str | None, as_user: str | None, as_json: bool) -> None:
    """Show the error log, newest first, each with its message and traceback."""
    when = parse_since(since)
    emit(run_core(state, lambda: core.error_page(
        actor_of(as_user), guild_id, script_id, plans=state.settings.plans, limit=limit,
        status=status, since=when)), as_json, _errors_text)


def _pcts(latency: dict[str, Any]) -> str:
    if not latency.get("count"):
        return "- (no requests in the window)"
    err = latency["relativeError"] * 100
    return (f"p50 {duration(latency['p50'])}  p90 {duration(latency['p90'])}  "
            f"p99 {duration(latency['p99'])}  ({latency['count']} requests, within {err:g} %)")


def _stats_text(d: dict[str, Any]) -> str:
    by_status: Sequence[tuple[str, Any]] = sorted(d["byStatus"].items())
    pairs: list[tuple[str, Any]] = [
        ("requests (30 days)", d["total"]), ("requests (24 h)", d["last24h"]),
        ("average duration", duration(d["avgMs"])),
        ("by status", "  ".join(f"{status_colour(s)}: {n}" for s, n in by_status) or "-"),
    ]
    if not d.get("advanced"):
        pairs.append(("advanced statistics", "not on this plan"))
        return fields(pairs)
    pairs.append(("latency (24 h)", _pcts(d["latency"])))
    pairs.append(("top callers", "  ".join(f"{t['ip']} ({t['count']})" for t in d["topIps"]) or "-"))
    hours = d["perHour"][-6:]           # the last six hours with requests
    text = fields(pairs)
    if hours:
        text += "\n\n" + table(("HOUR", "REQUESTS", "AVERAGE"),
                               [(local_time(p["time"])[:-3], p["total"], duration(p["avgMs"]))
                                for p in hours])
    return text


@cli.command("stats")
@click.argument("guild_id")
@click.argument("script_id")
@as_option
@json_option
@pass_state
def stats(state: State, guild_id: str, script_id: str, as_user: str | None, as_json: bool) -> None:
    """Show request statistics (docs/operations.md explains every field)."""
    emit(run_core(state, lambda: core.stats(actor_of(as_user), guild_id, script_id,
                                            plans=state.settings.plans)), as_json, _stats_text)
