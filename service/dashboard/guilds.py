"""Guild pages: the list of the user's guilds, and one guild's overview.

The overview shows the plan, endpoints used / allowed, the scripts, the
managers (the owner adds and removes them) and the audit log.  A guild the
user neither owns nor manages is 404, like one that does not exist.
"""
from __future__ import annotations

from typing import Any

from service import core
from service.core.access import Actor
from service.core.errors import CoreError
from service.dashboard.base import DashboardHandler, PageError
from service.plans import Plan


def overview(actor: Actor, guild_id: str, plans: Any) -> dict[str, Any]:
    """Everything the overview shows, in one trip to the thread pool."""
    guild = core.show_guild(actor, guild_id, plans=plans)
    return {"guild": guild,
            "scripts": core.list_scripts(actor, guild_id)["scripts"],
            "audit": core.audit_log(actor, guild_id, limit=50)["audit"]}


def plan_line(plan: Plan) -> str:
    """What a plan gives, in one line."""
    if plan.endpoints == 0:
        return "no endpoints"
    return (f"{plan.endpoints} endpoints, {plan.requests_per_minute} requests/min each, "
            f"history of {plan.history}"
            + (", IP whitelist" if plan.ip_whitelist else "")
            + (", advanced statistics" if plan.advanced_stats else ""))


class GuildListHandler(DashboardHandler):
    """`GET /dashboard`: the guilds the user owns or manages."""

    async def get(self) -> None:
        plans = self.dashboard.settings.plans
        data = await self.core(core.list_guilds, self.actor, plans=plans)
        self.page("guilds.html", title="Your guilds", guilds=data["guilds"])


class GuildHandler(DashboardHandler):
    """`GET /dashboard/G`: the overview."""

    async def get(self, guild_id: str) -> None:
        await self.show(guild_id)

    async def show(self, guild_id: str, status: int = 200, error: str | None = None,
                   notice: str | None = None) -> None:
        plans = self.dashboard.settings.plans
        data = await self.core(overview, self.actor, guild_id, plans)
        guild = data["guild"]
        plan = plans.get(guild["plan"])
        self.page("guild.html", status=status, title=f"Guild {guild_id}", error=error,
                  notice=notice, is_owner=guild["ownerId"] == self.actor.user_id,
                  plan_text=plan_line(plan) if plan else guild["plan"], **data)


class ManagersHandler(GuildHandler):
    """`POST /dashboard/G/managers`: the owner adds or removes a manager."""

    async def post(self, guild_id: str) -> None:
        plans = self.dashboard.settings.plans
        guild = (await self.core(overview, self.actor, guild_id, plans))["guild"]
        if guild["ownerId"] != self.actor.user_id:
            raise PageError(403, "Only the guild owner adds and removes managers.")
        action = self.get_body_argument("action", "")
        user_id = self.get_body_argument("user_id", "").strip()
        fn = {"add": core.add_manager, "remove": core.remove_manager}.get(action)
        if fn is None:
            raise PageError(400, "Unknown action.")
        try:
            await self.core_raw(fn, self.actor, guild_id, user_id, plans=plans)
        except CoreError as err:
            await self.show(guild_id, status=400, error=err.message)
            return
        self.redirect(f"/dashboard/{guild_id}#managers", status=303)
