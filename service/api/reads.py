"""History (pages, filters, one record), error log and statistics of a script's endpoint."""
from __future__ import annotations

from service.api import schemas
from service.api.base import APIHandler
from service.api.spec import operation
from service.core import pages, reads


class HistoryHandler(APIHandler):
    @operation("listHistory", "Request records, newest first", "owner, manager, operator",
               schemas.RequestRecordPage, query=schemas.HistoryQuery)
    async def get(self, guildId: str, scriptId: str) -> None:
        q = self.query(schemas.HistoryQuery)
        self.reply(await self.read(pages.history_page, self.actor, guildId, scriptId,
                                   limit=q.limit, cursor=q.cursor, status=q.status or None,
                                   since=q.since or None, plans=self.plans))


class RecordHandler(APIHandler):
    @operation("getHistoryRecord", "One request record in full", "owner, manager, operator",
               schemas.RequestRecord)
    async def get(self, guildId: str, scriptId: str, requestId: str) -> None:
        self.reply(await self.read(pages.history_record, self.actor, guildId, scriptId,
                                   requestId, plans=self.plans))


class ErrorsHandler(APIHandler):
    @operation("listErrors", "Error records, newest first", "owner, manager, operator",
               schemas.ErrorRecordPage, query=schemas.ListQuery, errors=(409,))
    async def get(self, guildId: str, scriptId: str) -> None:
        q = self.query(schemas.ListQuery)
        self.reply(await self.read(pages.errors_page, self.actor, guildId, scriptId,
                                   limit=q.limit, cursor=q.cursor, plans=self.plans))


class StatsHandler(APIHandler):
    @operation("getStats", "Statistics (advanced on plans that have them)",
               "owner, manager, operator", schemas.Stats)
    async def get(self, guildId: str, scriptId: str) -> None:
        self.reply(await self.read(reads.stats, self.actor, guildId, scriptId, plans=self.plans))


routes = [
    ("/api/v1/guilds/{guildId}/scripts/{scriptId}/history", HistoryHandler),
    ("/api/v1/guilds/{guildId}/scripts/{scriptId}/history/{requestId}", RecordHandler),
    ("/api/v1/guilds/{guildId}/scripts/{scriptId}/errors", ErrorsHandler),
    ("/api/v1/guilds/{guildId}/scripts/{scriptId}/stats", StatsHandler),
]
