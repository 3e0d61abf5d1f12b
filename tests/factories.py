"""Helpers that build rows through the service layer (the only writer)."""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from service import core
from service.core.records import RequestRecordIn

OPERATOR = core.Actor.operator()
OWNER = core.Actor.user("100")
MANAGER = core.Actor.user("200")
STRANGER = core.Actor.user("300")
SOURCE = "on endpoint(event):\n    event.reply({'ok': True})\n"
_guilds = iter(range(10_000, 99_999))


def large_source(tag: str = "", count: int = 850) -> str:
    """~250 KB (at 850) of ordinary functions (~70,000 tokens), then SOURCE: a
    save-time compile of 0.6-2 s of CPU, within the 5 s budget."""
    block = (f"def handler_{tag}{{i}}(event, data):\n    total = 0\n"
             "    for item in data.get('items', []):\n"
             "        if item.get('price', 0) > 10:\n"
             "            total += item['price'] * item.get('qty', 1)\n"
             "        else:\n            total -= 1\n"
             "    result = {{'total': total, 'name': 'handler_{i}', 'ok': total > 0}}\n"
             "    return result\n\n")
    return "".join(block.format(i=i) for i in range(count)) + SOURCE


def make_guild(plan: str = "pro", guild_id: str | None = None, manager: bool = True) -> str:
    """A guild owned by OWNER (with MANAGER) on `plan`; returns its id."""
    gid = guild_id or str(next(_guilds))
    core.create_guild(OPERATOR, gid, OWNER.user_id or "", plan)
    if manager:
        core.add_manager(OPERATOR, gid, MANAGER.user_id or "")
    return gid


def make_script(guild_id: str, name: str = "s", source: str = SOURCE) -> str:
    """A script in the guild; returns its logicScriptId."""
    return str(core.create_script(OWNER, guild_id, name, source)["logicScriptId"])


def make_request(endpoint_id: int, n: int, keep: int = 20, **overrides: Any) -> RequestRecordIn:
    """A request record numbered `n` (request id "r<n>")."""
    fields: dict[str, Any] = dict(
        endpoint_id=endpoint_id, request_id=f"r{n}", time=datetime.now(timezone.utc),
        method="POST", query={"a": "1"}, headers={"content-type": "application/json"},
        body=b'{"n": %d}' % n, ip="203.0.113.7", user_agent="curl/8", status=200,
        response_headers={"content-type": "application/json"}, response_body=b'{"ok":true}',
        duration_ms=3.5, output="hi\n", error=None, keep=keep)
    fields.update(overrides)
    return RequestRecordIn(**fields)
