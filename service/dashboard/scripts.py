"""The script page: its source (compile errors at their lines) and its Endpoints tab.

The Endpoints tab shows the URL, the enable switch, the secret (create or
regenerate: owner only, shown once), the IP whitelist, history, the error
log and statistics with charts.  Every change goes through `service.core`
with the viewer's own actor, so the roles are the service layer's.
"""
from __future__ import annotations

import re
from typing import Any

from service import core
from service.core import pages, scripts
from service.core.access import Actor
from service.core.charts import request_series
from service.core.errors import CoreError, QuotaError, ValidationError, VersionMismatchError
from service.core.secrets import secret_state
from service.dashboard.base import DashboardHandler, PageError
from service.dashboard.charts import bar_chart, legend
from service.settings import Settings

#: Longest body shown on the page; the rest is cut with a note (history keeps
#: at most the plan's cap anyway).
SHOW_BYTES = 64 * 1024
#: History records on one page (older ones a link away).
HISTORY_PAGE = 25
_COMPILE_ERROR = re.compile(r"(\d+):(\d+): (.*?)(?=; \d+:\d+: |$)", re.S)


def compile_errors(err: ValidationError) -> list[dict[str, Any]]:
    """`[{line, column, message}]` of a `compile_error`."""
    listed = getattr(err, "errors", None)
    if listed:
        return [dict(e) if isinstance(e, dict) else
                {"line": e.line, "column": e.column, "message": e.message} for e in listed]
    text = err.message.split(": ", 1)[1] if ": " in err.message else err.message
    found = [{"line": int(m.group(1)), "column": int(m.group(2)), "message": m.group(3)}
             for m in _COMPILE_ERROR.finditer(text)]
    return found or [{"line": None, "column": None, "message": err.message}]


def shown_body(text: str | None, encoding: str = "text", truncated: bool = False) -> dict[str, Any]:
    """A body as the page shows it: cut at `SHOW_BYTES`, with what was cut said."""
    text = text or ""
    note = []
    if encoding == "base64":
        note.append("binary body, shown as base64")
    if truncated:
        note.append("truncated when stored")
    if len(text) > SHOW_BYTES:
        note.append(f"showing the first {SHOW_BYTES} of {len(text)} characters")
        text = text[:SHOW_BYTES]
    return {"text": text, "note": "; ".join(note)}


def load_script_page(actor: Actor, guild_id: str, script_id: str, settings: Settings,
                     history_cursor: str | None = None) -> dict[str, Any]:
    """Everything the script page shows, in one trip to the thread pool.

    History comes a page at a time (``HISTORY_PAGE`` records, ``history_cursor``
    for older ones): a pro endpoint's 200 records at the stored caps made a
    20 MB page (review, session 25). A cursor that is none shows the newest."""
    plans, base_url = settings.plans, settings.server.base_url
    guild = core.show_guild(actor, guild_id, plans=plans)
    script = core.show_script(actor, guild_id, script_id)
    endpoint = core.show_endpoint(actor, guild_id, script_id, plans=plans, base_url=base_url)
    try:
        page = pages.history_page(actor, guild_id, script_id, limit=HISTORY_PAGE,
                                  cursor=history_cursor, plans=plans)
    except ValidationError:
        history_cursor = None
        page = pages.history_page(actor, guild_id, script_id, limit=HISTORY_PAGE, plans=plans)
    records = page["items"]
    try:
        errors: list[dict[str, Any]] | None = core.error_log(
            actor, guild_id, script_id, plans=plans)["errors"]
    except QuotaError:
        errors = None
    stats = core.stats(actor, guild_id, script_id, plans=plans)
    try:    # charts are advanced statistics: only the plans that include them
        series: dict[str, Any] | None = request_series(actor, guild_id, script_id, plans=plans)
    except QuotaError:
        series = None
    plan = plans.get(guild["plan"])
    return {
        "guild": guild, "script": script, "revision": scripts.revision(script),
        "endpoint": endpoint, "endpoint_revision": core.endpoints.revision(endpoint),
        "records": records,
        "older_history": page["nextCursor"], "history_paged": history_cursor is not None,
        "errors": errors, "stats": stats, "plan": plan,
        "whitelist_plans": sorted(n for n, p in plans.items() if p.ip_whitelist),
        "chart_minutes": series and bar_chart(series["perMinute"],
                                              title="Requests per minute, last hour",
                                              label_every=10),
        "chart_hours": series and bar_chart(series["perHour"],
                                            title="Requests per hour, last 30 days",
                                            label_every=24 * 5, label="date"),
        "legend": legend(),
    }


class ScriptHandler(DashboardHandler):
    """`GET /dashboard/G/scripts/S` (`?tab=source` for the editor)."""

    async def get(self, guild_id: str, script_id: str) -> None:
        tab = "source" if self.get_query_argument("tab", "") == "source" else "endpoints"
        saved = self.get_query_argument("saved", "") == "1"
        await self.show(guild_id, script_id, tab=tab,
                        notice="Saved: a new version is live." if saved else None)

    async def show(self, guild_id: str, script_id: str, *, tab: str = "endpoints",
                   status: int = 200, **extra: Any) -> None:
        data = await self.core(load_script_page, self.actor, guild_id, script_id,
                               self.dashboard.settings, self.get_query_argument("history", None))
        values: dict[str, Any] = {"notice": None, "error": None, "field_error": {},
                                  "compile": None, "draft": None, "console": None,
                                  "draft_cidrs": None, "draft_revision": None,
                                  "whitelist_revision": None,
                                  "conflict": False}
        values.update(extra)
        self.page("script.html", status=status, title=data["script"]["name"], tab=tab,
                  is_owner=data["guild"]["ownerId"] == self.actor.user_id,
                  replaces=secret_state(data["endpoint"]["secret"]),
                  shown_body=shown_body, **data, **values)


class SourceHandler(ScriptHandler):
    """`POST .../source`: save a new version; compile errors come back at their lines."""

    async def post(self, guild_id: str, script_id: str) -> None:
        # As typed: Tornado strips an argument's surrounding whitespace by
        # default, which took the final newline off every save.
        source = self.get_body_argument("source", "", strip=False).replace("\r\n", "\n")
        # What the editor was opened on: a save made meanwhile elsewhere (the
        # API, another tab) is not overwritten unseen (review, session 27).
        revision = self.get_body_argument("revision", "") or None
        if revision is None:
            # A page from before the editor said what it opened (or a form
            # made by hand): saving it blind could replace a newer version.
            await self.show(guild_id, script_id, tab="source", status=409, conflict="unknown",
                            draft=source)
            return
        try:
            await self.core_raw(core.update_script, self.actor, guild_id, script_id, source,
                                expected_revision=revision)
        except VersionMismatchError:
            # The text stays; the form now carries the saved revision, so
            # saving again (after a look at the saved version) replaces it.
            await self.show(guild_id, script_id, tab="source", status=409, conflict=True,
                            draft=source)
            return
        except ValidationError as err:
            errors = compile_errors(err) if err.code == "compile_error" else [
                {"line": None, "column": None, "message": err.message}]
            await self.show(guild_id, script_id, tab="source", status=422, compile=errors,
                            draft=source, draft_revision=revision)
            return
        except CoreError:
            raise PageError(404, "Not found.") from None
        self.redirect(f"/dashboard/{guild_id}/scripts/{script_id}?tab=source&saved=1",
                      status=303)


class SwitchHandler(ScriptHandler):
    """`POST .../endpoint`: switch the endpoint on or off (quota refusal explained)."""

    async def post(self, guild_id: str, script_id: str) -> None:
        enabled = self.get_body_argument("enabled", "") == "on"
        plans = self.dashboard.settings.plans
        try:
            await self.core_raw(core.endpoints.set_enabled, self.actor, guild_id, script_id,
                                enabled, plans=plans)
        except QuotaError as err:
            await self.show(guild_id, script_id, status=409,
                            error=f"The endpoint stays off: {err.message}. Switch another "
                                  "endpoint off first, or ask for a bigger plan.")
            return
        except CoreError:
            raise PageError(404, "Not found.") from None
        self.redirect(f"/dashboard/{guild_id}/scripts/{script_id}#endpoint", status=303)


class WhitelistHandler(ScriptHandler):
    """`POST .../whitelist`: replace the IP whitelist (one CIDR per line)."""

    async def post(self, guild_id: str, script_id: str) -> None:
        text = self.get_body_argument("cidrs", "")
        cidrs = [c.strip() for c in re.split(r"[\s,]+", text) if c.strip()]
        # What the page showed: a whitelist changed meanwhile elsewhere (the
        # API, the chat command, another tab) is not undone unseen by a form
        # sent from an older page (review, session 33); a form that names
        # nothing (made by hand) is refused the same way.
        revision = self.get_body_argument("revision", "") or "none"
        plans = self.dashboard.settings.plans
        try:
            await self.core_raw(core.set_whitelist, self.actor, guild_id, script_id, cidrs,
                                plans=plans, expected_revision=revision)
        except VersionMismatchError:
            now = await self.core(core.show_endpoint, self.actor, guild_id, script_id, plans=plans)
            saved = ", ".join(now["whitelist"]) or "empty (any address)"
            await self.show(guild_id, script_id, status=409, draft_cidrs=text, field_error={
                "cidrs": f"The endpoint was changed elsewhere after this page was loaded; its "
                         f"whitelist is now {saved}. Your text is kept: save again to replace it."})
            return
        except (ValidationError, QuotaError) as err:
            # The form still says what its page showed: a save after fixing the
            # text is checked against that, not against the state now (review,
            # session 33: a typo's re-render let the next save undo a change).
            await self.show(guild_id, script_id, status=400 if isinstance(err, ValidationError)
                            else 409, field_error={"cidrs": err.message}, draft_cidrs=text,
                            whitelist_revision=revision)
            return
        except CoreError:
            raise PageError(404, "Not found.") from None
        self.redirect(f"/dashboard/{guild_id}/scripts/{script_id}#whitelist", status=303)


class SecretHandler(DashboardHandler):
    """`POST .../secret`: create or regenerate the secret (owner only); shown once.

    Answers JSON to the page's script (`Accept: application/json`), which
    shows it in a dialog; without script, a page that shows it once."""

    async def post(self, guild_id: str, script_id: str) -> None:
        plans = self.dashboard.settings.plans
        guild = await self.core(core.show_guild, self.actor, guild_id, plans=plans)  # strangers: 404
        if guild["ownerId"] != self.actor.user_id:
            raise PageError(403, "Only the guild owner creates or regenerates the secret.")
        if self.get_body_argument("confirm", "") != "yes":
            # The dialog (or, without script, a checkbox) confirms that the old
            # secret dies at once: a bare POST changes nothing.
            raise PageError(400, "Confirm first: the current secret stops working at once.")
        # The secret the page showed ("<createdAt>/<hint>", or "none"): a form sent
        # again (a reload of the page that shows the new secret) finds another
        # one and changes nothing (409), instead of killing the secret just shown.
        replaces = self.get_body_argument("replaces", "")
        if not replaces:
            raise PageError(400, "Reload the page and confirm again.")
        made = await self.core(core.regenerate_secret, self.actor, guild_id, script_id,
                               deny=403, replaces=replaces)
        if self.request.headers.get("Accept", "").startswith("application/json"):
            self.write_json({"secret": made["secret"], "hint": made["hint"]}, 201)
            return
        self.page("secret.html", status=201, title="Your new secret", secret=made["secret"],
                  back=f"/dashboard/{guild_id}/scripts/{script_id}")
