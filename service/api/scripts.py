"""`/api/v1/guilds/G/scripts[/S]`: list, create, show (`ETag`), update (`If-Match`), delete."""
from __future__ import annotations

import re

from service.api import schemas
from service.api.base import ApiError, APIHandler
from service.api.spec import operation
from service.core import pages, scripts

#: A script source is at most 256 KB; JSON escaping may grow it, the core checks the real size.
SCRIPT_BODY_CAP = 1024 * 1024
#: A strong ETag (If-Match compares strongly: RFC 9110 13.1.1; a weak one never matches).
_ETAG = re.compile(r'\s*"?([0-9]{1,18}(?:-[0-9a-f]{8})?)"?\s*')


def expected_revision(header: str | None) -> str | None:
    """The revision an `If-Match` header names (`scripts.revision`); None without
    one (or `*`). Raises 412 `version_mismatch` for a value that names none."""
    if header is None or header.strip() == "*":
        return None
    match = _ETAG.fullmatch(header)
    if match is None:
        raise ApiError(412, "version_mismatch",
                       "If-Match must be the ETag of a read, e.g. \"3-1a2b3c4d\"")
    return match.group(1)


def _etag(view: dict[str, object]) -> str:
    return f'"{scripts.revision(view)}"'


class ScriptsHandler(APIHandler):
    body_cap = SCRIPT_BODY_CAP

    @operation("listScripts", "The guild's scripts, oldest first", "owner, manager, operator",
               schemas.ScriptPage, query=schemas.ListQuery)
    async def get(self, guildId: str) -> None:
        q = self.query(schemas.ListQuery)
        self.reply(await self.call(pages.scripts_page, self.actor, guildId, limit=q.limit,
                                   cursor=q.cursor))

    @operation("createScript", "Create a script (its endpoint starts disabled)",
               "owner, manager, operator", schemas.Script, status=201, body=schemas.ScriptCreate,
               errors=(409, 422), links={op: (op, {"guildId": "$response.body#/guildId",
                                               "scriptId": "$response.body#/logicScriptId"})
                                     for op in ("getScript", "updateScript", "getEndpoint",
                                                "patchEndpoint", "testCall", "listHistory",
                                                "getStats", "listErrors", "deleteScript")})
    async def post(self, guildId: str) -> None:
        b = self.body(schemas.ScriptCreate)
        created = await self.call(scripts.create_script, self.actor, guildId, b.name, b.source)
        self.set_header("ETag", _etag(created))
        self.reply(created, 201)


class ScriptHandler(APIHandler):
    body_cap = SCRIPT_BODY_CAP

    @operation("getScript", "The script with its source and version",
               "owner, manager, operator", schemas.Script,
               response_headers={"ETag": "The revision read (the version and a tag of the "
                                         "name), quoted: send it back in If-Match."})
    async def get(self, guildId: str, scriptId: str) -> None:
        shown = await self.call(scripts.show_script, self.actor, guildId, scriptId)
        self.set_header("ETag", _etag(shown))
        self.reply(shown)

    @operation("updateScript", "Replace the source and/or rename", "owner, manager, operator",
               schemas.Script, body=schemas.ScriptUpdate, errors=(409, 412, 422),
               request_headers={"If-Match": "The ETag read: refused with 412 if another "
                                            "editor saved or renamed since."},
               response_headers={"ETag": "The new revision, quoted."})
    async def put(self, guildId: str, scriptId: str) -> None:
        b = self.body(schemas.ScriptUpdate)
        revision = expected_revision(self.request.headers.get("If-Match"))
        updated = await self.call(scripts.update_script, self.actor, guildId, scriptId,
                                  source=b.source, name=b.name, expected_revision=revision)
        self.set_header("ETag", _etag(updated))
        self.reply(updated)

    @operation("deleteScript", "Delete the script, its endpoint, history and statistics",
               "owner, manager, operator", schemas.Deleted)
    async def delete(self, guildId: str, scriptId: str) -> None:
        self.reply(await self.call(scripts.delete_script, self.actor, guildId, scriptId))


routes = [
    ("/api/v1/guilds/{guildId}/scripts", ScriptsHandler),
    ("/api/v1/guilds/{guildId}/scripts/{scriptId}", ScriptHandler),
]
