"""`/api/v1/me`, guilds, managers and the audit log."""
from __future__ import annotations

from service.api import schemas
from service.api.base import APIHandler
from service.api.spec import operation
from service.core import guilds, pages


class MeHandler(APIHandler):
    @operation("getMe", "Who the token acts as", "any token", schemas.Me)
    async def get(self) -> None:
        self.reply({"userId": self.actor.user_id, "operator": self.identity.actor.is_operator,
                    "tokenId": self.identity.token_id,
                    "expiresAt": (self.identity.expires_at.isoformat(timespec="milliseconds") + "Z"
                                  if self.identity.expires_at else None)})


class GuildsHandler(APIHandler):
    @operation("listGuilds", "Guilds the actor owns or manages (operator: all)", "any token",
               schemas.GuildPage, query=schemas.ListQuery)
    async def get(self) -> None:
        q = self.query(schemas.ListQuery)
        self.reply(await self.call(pages.guilds_page, self.actor, limit=q.limit,
                                   cursor=q.cursor, plans=self.plans))

    @operation("createGuild", "Register a guild", "operator", schemas.Guild, status=201,
               body=schemas.GuildCreate, errors=(409,),
               links={"getGuild": ("getGuild", {"guildId": "$response.body#/guildId"}),
                      "listScripts": ("listScripts", {"guildId": "$response.body#/guildId"}),
                      "createScript": ("createScript", {"guildId": "$response.body#/guildId"})})
    async def post(self) -> None:
        b = self.body(schemas.GuildCreate)
        self.reply(await self.call(guilds.create_guild, self.actor, b.guildId, b.ownerId, b.plan,
                                   plans=self.plans), 201)


class GuildHandler(APIHandler):
    @operation("getGuild", "Plan, limits, endpoints used and allowed, owner, managers",
               "owner, manager, operator", schemas.Guild)
    async def get(self, guildId: str) -> None:
        self.reply(await self.call(guilds.show_guild, self.actor, guildId, plans=self.plans))

    @operation("patchGuild", "Change the plan (a downgrade disables endpoints, newest first)",
               "operator", schemas.Guild, body=schemas.GuildPatch, query=schemas.DryRunQuery)
    async def patch(self, guildId: str) -> None:
        b = self.body(schemas.GuildPatch)
        dry = self.query(schemas.DryRunQuery).dryRun
        self.reply(await self.call(guilds.set_plan, self.actor, guildId, b.plan,
                                   plans=self.plans, dry_run=dry))


class ManagerHandler(APIHandler):
    @operation("addManager", "Add a manager (idempotent)", "owner, operator", schemas.Guild)
    async def put(self, guildId: str, userId: str) -> None:
        self.reply(await self.call(guilds.add_manager, self.actor, guildId, userId,
                                   plans=self.plans))

    @operation("removeManager", "Remove a manager", "owner, operator", schemas.Guild)
    async def delete(self, guildId: str, userId: str) -> None:
        self.reply(await self.call(guilds.remove_manager, self.actor, guildId, userId,
                                   plans=self.plans))


class AuditHandler(APIHandler):
    @operation("listAudit", "Audit records, newest first", "owner, manager, operator",
               schemas.AuditPage,
               query=schemas.ListQuery)
    async def get(self, guildId: str) -> None:
        q = self.query(schemas.ListQuery)
        self.reply(await self.call(pages.audit_page, self.actor, guildId, limit=q.limit,
                                   cursor=q.cursor))


routes = [
    ("/api/v1/me", MeHandler),
    ("/api/v1/guilds", GuildsHandler),
    ("/api/v1/guilds/{guildId}", GuildHandler),
    ("/api/v1/guilds/{guildId}/managers/{userId}", ManagerHandler),
    ("/api/v1/guilds/{guildId}/audit", AuditHandler),
]
