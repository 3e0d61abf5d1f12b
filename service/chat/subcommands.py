"""One small function per subcommand: call the service layer, format the answer.

Each takes a `Call` (who, where, the options) and returns the message text;
a service-layer refusal is raised as it is and `service.chat.commands`
turns it into an ephemeral answer.  Whether a successful answer is ephemeral
is declared in the command table, not here.  No rule lives here: roles,
plans, quotas and the secret's owner-only rule are all `service.core`'s.
"""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Any, Mapping

from service import core
from service.core.access import Actor
from service.core.member_links import member_login_link
from service.settings import Settings

#: History lines shown by `/logic script history`.
HISTORY_SHOWN = 5
_SCRIPT_ID = re.compile(r"logic_[A-Za-z0-9_-]{22}")
_MARKDOWN = re.compile(r"([\\`*_~|<>\[\]])")


@dataclass(frozen=True)
class Call:
    """One command: the acting member, their guild, the options they gave."""

    actor: Actor
    guild_id: str
    options: Mapping[str, str]
    settings: Settings


def plain(text: str) -> str:
    """User-given text (a script name) shown literally, not as markdown, nor as a
    link: a zero-width space after the colon of ``://`` (names cannot hold one)
    keeps the platform from linking a name such as ``https://evil.example``
    in a message posted under the application's name (review, session 27)."""
    return _MARKDOWN.sub(r"\\\1", text.replace("\n", " ")).replace("://", ":\u200b//")


def resolve_script(call: Call) -> tuple[str, str]:
    """The `script` option (a `logic_` ID or a name) as (script ID, name).
    Raises `NotFoundError`, `PermissionDeniedError`, `ValidationError`."""
    text = unicodedata.normalize("NFC", call.options.get("script", "").strip())  # as names are
    scripts = core.list_scripts(call.actor, call.guild_id)["scripts"]
    if _SCRIPT_ID.fullmatch(text):
        found = [s for s in scripts if s["logicScriptId"] == text]
    else:
        # Exactly as typed, else as names are compared (any normal form or case).
        key = core.scripts.name_key
        found = [s for s in scripts if s["name"] == text] or \
                [s for s in scripts if key(s["name"]) == key(text)]
    if not found:
        raise core.NotFoundError(f"no script {text!r} in this server; /logic script list shows them",
                                 code="script_not_found")
    if len(found) > 1:
        ids = ", ".join(s["logicScriptId"] for s in found)
        raise core.ValidationError(f"several scripts are named {text!r}; give the ID: {ids}",
                                   code="ambiguous_script")
    return found[0]["logicScriptId"], found[0]["name"]


def suggest_scripts(call: Call, typed: str) -> list[tuple[str, str]]:
    """Autocomplete: the guild's scripts whose name or ID contains what was typed."""
    needle = typed.strip().casefold()
    scripts = core.list_scripts(call.actor, call.guild_id)["scripts"]
    return [(f"{s['name']} ({s['logicScriptId']})", s["logicScriptId"]) for s in scripts
            if needle in s["name"].casefold() or needle in s["logicScriptId"].casefold()]


def _title(name: str, script_id: str) -> str:
    return f"**{plain(name)}** `{script_id}`"


def script_list(call: Call) -> str:
    scripts = core.list_scripts(call.actor, call.guild_id)["scripts"]
    if not scripts:
        return "No scripts in this server yet."
    lines = [f"Scripts in this server ({len(scripts)}):"]
    lines += [f"- {_title(s['name'], s['logicScriptId'])}: endpoint "
              f"{'on' if s['endpointEnabled'] else 'off'}" for s in scripts]
    return "\n".join(lines)


def _endpoint_text(name: str, view: Mapping[str, Any]) -> str:
    state = "on" if view["enabled"] else "off"
    if view["enabled"] and not view["active"]:
        state += f" (but the {view['plan']} plan has no endpoints, so it answers 403)"
    secret = view["secret"]
    secret_text = ("none yet: the owner creates it with /logic script secret" if secret is None
                   else f"ends in `{secret['hint']}`, created {secret['createdAt']}")
    whitelist = ", ".join(f"`{c}`" for c in view["whitelist"]) or "none (any address)"
    return "\n".join([_title(name, view["logicScriptId"]), f"URL: <{view['url']}>",
                      f"Endpoint: {state}", f"Secret: {secret_text}",
                      f"IP whitelist: {whitelist}"])


def script_show(call: Call) -> str:
    script_id, name = resolve_script(call)
    view = core.show_endpoint(call.actor, call.guild_id, script_id, plans=call.settings.plans,
                              base_url=call.settings.server.base_url)
    return _endpoint_text(name, view)


def script_enable(call: Call) -> str:
    script_id, name = resolve_script(call)
    core.enable_endpoint(call.actor, call.guild_id, script_id, plans=call.settings.plans)
    return f"Endpoint of {_title(name, script_id)} is now **on** (by <@{call.actor.user_id}>)."


def script_disable(call: Call) -> str:
    script_id, name = resolve_script(call)
    core.disable_endpoint(call.actor, call.guild_id, script_id, plans=call.settings.plans)
    return f"Endpoint of {_title(name, script_id)} is now **off** (by <@{call.actor.user_id}>)."


def script_secret(call: Call) -> str:
    script_id, name = resolve_script(call)
    made = core.regenerate_secret(call.actor, call.guild_id, script_id)
    return (f"New secret for {_title(name, script_id)}:\n`{made['secret']}`\n"
            "It is shown only this once: copy it now. The previous secret, if there was one, "
            "stopped working at this moment.")


def script_whitelist(call: Call) -> str:
    script_id, name = resolve_script(call)
    raw = call.options.get("cidrs", "").replace(",", " ").split()
    cidrs = [] if [c.lower() for c in raw] == ["none"] else raw
    view = core.set_whitelist(call.actor, call.guild_id, script_id, cidrs,
                              plans=call.settings.plans)
    shown = ", ".join(f"`{c}`" for c in view["whitelist"])
    return (f"IP whitelist of {_title(name, script_id)}: {shown}" if shown
            else f"IP whitelist of {_title(name, script_id)} cleared: any address may call it.")


def script_history(call: Call) -> str:
    script_id, name = resolve_script(call)
    records = core.history(call.actor, call.guild_id, script_id,
                           plans=call.settings.plans)["records"][:HISTORY_SHOWN]
    if not records:
        return f"No requests recorded for {_title(name, script_id)} yet."
    lines = [f"Last {len(records)} request(s) of {_title(name, script_id)}, newest first:"]
    for r in records:
        error = f" {plain(r['error'])}" if r.get("error") else ""
        lines.append(f"- `{r['time']}` {r['method']} **{r['status']}** {r['durationMs']:.0f} ms "
                     f"from `{r['ip']}` `{r['requestId']}`{error}")
    return "\n".join(lines)


def script_stats(call: Call) -> str:
    script_id, name = resolve_script(call)
    stats = core.stats(call.actor, call.guild_id, script_id, plans=call.settings.plans)
    by_status = ", ".join(f"{k}: {v}" for k, v in stats["byStatus"].items()) or "none"
    avg = "n/a" if stats["avgMs"] is None else f"{stats['avgMs']:.1f} ms"
    lines = [f"Statistics of {_title(name, script_id)} (30 days):",
             f"Requests: {stats['total']} (last 24 h: {stats['last24h']}); by status: {by_status}",
             f"Average duration: {avg}"]
    if stats.get("latency"):
        lat = stats["latency"]
        if lat["p50"] is not None:
            lines.append(f"Latency over 24 h (within 1 %): p50 {lat['p50']:g} ms, "
                         f"p90 {lat['p90']:g} ms, p99 {lat['p99']:g} ms")
        top = ", ".join(f"`{t['ip']}` ({t['count']})" for t in stats.get("topIps", [])[:5])
        if top:
            lines.append(f"Top callers: {top}")
    elif not stats["advanced"]:
        lines.append("Latency percentiles and top callers come with a plan that has advanced "
                     "statistics.")
    return "\n".join(lines)


def dashboard(call: Call) -> str:
    link = member_login_link(call.actor, call.guild_id, call.settings.server.base_url)
    return (f"Your one-time dashboard login link (until {link['expiresAt']}; it works once):\n"
            f"<{link['url']}>\nDo not share it: it logs in as you.")
