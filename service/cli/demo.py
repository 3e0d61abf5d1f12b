"""`logic demo`: a demo guild on pro, a score-validating script, its endpoint enabled, a secret
and a dashboard login link for the demo owner.

Running it again on the same database reuses the guild and script and makes a
new secret (the old one cannot be shown again: only its hash is stored).
"""

from __future__ import annotations

import dataclasses
import secrets as _random
import shlex
from dataclasses import dataclass

from service.settings import Settings

DEMO_GUILD_ID = "100000000000000001"
DEMO_OWNER_ID = "200000000000000001"
DEMO_SCRIPT_NAME = "demo-score"

DEMO_SOURCE = '''\
import json

def valid(d):
    return isinstance(d, dict) and isinstance(d.get("score"), int)

on endpoint(event):
    if not valid(event.body):
        event.status(422)
        event.reply({"error": "score must be an integer"})
        return
    print("score from", event.ip)
    event.reply({"ok": True, "double": event.body["score"] * 2})
'''


@dataclass(frozen=True)
class Demo:
    url: str
    secret: str
    guild_id: str
    script_id: str
    login_url: str = ""

    @property
    def curl(self) -> str:
        return (f"curl -sS -X POST {shlex.quote(self.url)} "
                f"-H {shlex.quote('Authorization: Bearer ' + self.secret)} "
                "-H 'Content-Type: application/json' -d '{\"score\": 21}'")


def setup_demo(settings: Settings) -> Demo:
    """Create (or reuse) the demo guild, script and endpoint; return a fresh secret."""
    from models.db import connect
    from models.migrate import Runner
    from service.core import endpoints, guilds, scripts, secrets, tokens
    from service.core.access import Actor
    from service.core.errors import ConflictError

    db = connect(settings.database.url)
    Runner(db).upgrade()
    secrets.configure(settings.server.cookie_secret)
    operator, owner = Actor.operator(), Actor.user(DEMO_OWNER_ID)
    try:
        guilds.create_guild(operator, DEMO_GUILD_ID, DEMO_OWNER_ID, "pro", plans=settings.plans)
    except ConflictError:
        guilds.set_plan(operator, DEMO_GUILD_ID, "pro", plans=settings.plans)
    existing = [s for s in scripts.list_scripts(owner, DEMO_GUILD_ID)["scripts"]
                if s["name"] == DEMO_SCRIPT_NAME]
    if existing:
        script_id = existing[0]["logicScriptId"]
        scripts.update_script(owner, DEMO_GUILD_ID, script_id, DEMO_SOURCE)
    else:
        script_id = scripts.create_script(owner, DEMO_GUILD_ID, DEMO_SCRIPT_NAME,
                                          DEMO_SOURCE)["logicScriptId"]
    endpoints.enable_endpoint(owner, DEMO_GUILD_ID, script_id, plans=settings.plans)
    secret = secrets.regenerate_secret(owner, DEMO_GUILD_ID, script_id)["secret"]
    login_url = tokens.create_login_link(operator, DEMO_OWNER_ID, settings.server.base_url)["url"]
    db.close()
    url = endpoints.endpoint_url(settings.server.base_url, DEMO_GUILD_ID, script_id)
    return Demo(url=url, secret=secret, guild_id=DEMO_GUILD_ID, script_id=script_id,
                login_url=login_url)


def with_cookie_secret(settings: Settings) -> Settings:
    """The demo's settings: a fresh random cookie secret unless one is configured
    (sessions then last as long as this demo process)."""
    if settings.server.cookie_secret:
        return settings
    server = dataclasses.replace(settings.server, cookie_secret=_random.token_urlsafe(32))
    return dataclasses.replace(settings, server=server)
