"""The endpoint of a script: show, switch and whitelist, secret, test calls and replays."""
from __future__ import annotations

import re
from typing import Any

from models import database
from service.api import schemas
from service.api.base import ApiError, APIHandler
from service.api.spec import operation
from service.core import endpoints, secrets, testcalls
from service.core.access import Actor
from service.http.testcall import run_test_call
from service.plans import Plan

#: The JSON of a test call (its body is then checked against the plan).
TEST_BODY_CAP = 1024 * 1024


#: A settings revision as `If-Match` names it (`endpoints.revision`), quoted or not.
_ETAG = re.compile(r'\s*"?([0-9a-f]{16})"?\s*')


def patch_endpoint(actor: Actor, guild_id: str, script_id: str, enabled: bool | None,
                   whitelist: list[str] | None, *, plans: dict[str, Plan],
                   base_url: str, expected_revision: str | None = None) -> dict[str, Any]:
    """Both changes in one transaction (all or nothing), the whitelist first: an
    endpoint is never on without its new whitelist. `expected_revision` is
    checked against the state before either."""
    view: dict[str, Any] | None = None
    with database.atomic():
        if whitelist is not None:
            view = endpoints.set_whitelist(actor, guild_id, script_id, whitelist, plans=plans,
                                           base_url=base_url, expected_revision=expected_revision)
            expected_revision = None
        if enabled is not None:
            view = endpoints.set_enabled(actor, guild_id, script_id, enabled, plans=plans,
                                         base_url=base_url, expected_revision=expected_revision)
    assert view is not None
    return view


def expected_revision(header: str | None) -> str | None:
    """The revision an `If-Match` header names; None without one (or `*`).
    Raises 412 `version_mismatch` for a value that names none."""
    if header is None or header.strip() == "*":
        return None
    match = _ETAG.fullmatch(header)
    if match is None:
        raise ApiError(412, "version_mismatch", "If-Match must be the ETag of a read")
    return match.group(1)


class EndpointHandler(APIHandler):
    @operation("getEndpoint", "URL, switch, secret hint (never the secret), whitelist",
               "owner, manager, operator", schemas.Endpoint,
               response_headers={"ETag": "The switch and whitelist read, quoted: send it back "
                                         "in If-Match."})
    async def get(self, guildId: str, scriptId: str) -> None:
        shown = await self.call(endpoints.show_endpoint, self.actor, guildId, scriptId,
                                plans=self.plans, base_url=self.base_url)
        self.set_header("ETag", f'"{endpoints.revision(shown)}"')
        self.reply(shown)

    @operation("patchEndpoint", "Switch on or off and/or replace the IP whitelist",
               "owner, manager, operator", schemas.Endpoint, body=schemas.EndpointPatch,
               errors=(409, 412),
               request_headers={"If-Match": "The ETag read (optional): refused with 412 if "
                                            "the switch or whitelist changed since."},
               response_headers={"ETag": "The new revision, quoted."})
    async def patch(self, guildId: str, scriptId: str) -> None:
        b = self.body(schemas.EndpointPatch)
        if b.enabled is None and b.whitelist is None:
            raise ApiError(400, "invalid_input", "give enabled and/or whitelist")
        revision = expected_revision(self.request.headers.get("If-Match"))
        done = await self.call(patch_endpoint, self.actor, guildId, scriptId, b.enabled,
                               b.whitelist, plans=self.plans, base_url=self.base_url,
                               expected_revision=revision)
        self.set_header("ETag", f'"{endpoints.revision(done)}"')
        self.reply(done)


class SecretHandler(APIHandler):
    @operation("createSecret", "Create or regenerate the secret; shown only in this answer",
               "owner only", schemas.NewSecret, status=201,
               response_headers={"Cache-Control": "no-store"})
    async def post(self, guildId: str, scriptId: str) -> None:
        self.set_header("Cache-Control", "no-store")
        self.set_header("Pragma", "no-cache")
        self.reply(await self.call(secrets.regenerate_secret, self.actor, guildId, scriptId), 201)


class TestCallHandler(APIHandler):
    body_cap = TEST_BODY_CAP

    @operation("testCall", "Run a request through the whole pipeline without the secret "
               "(marked as a test call)", "owner, manager, operator", schemas.TestCallResult,
               body=schemas.TestCall, errors=(409, 503),
               links={op: (op, {"guildId": "$request.path.guildId",
                                "scriptId": "$request.path.scriptId",
                                "requestId": "$response.body#/requestId"})
                      for op in ("getHistoryRecord", "replay")})
    async def post(self, guildId: str, scriptId: str) -> None:
        b = self.body(schemas.TestCall)
        request = await self.call(testcalls.new_test_request, b.method, b.headers, b.body,
                                  b.query)
        target = await self.call(testcalls.test_target, self.actor, guildId, scriptId,
                                 plans=self.plans)
        await self.run(target, request)

    async def run(self, target: Any, request: testcalls.TestRequest) -> None:
        result = await run_test_call(self.context, target, request, ip=self.ip,
                                     request_id=self.request_id)
        for name, value in result.rate_headers.items():
            self.set_header(f"X-Endpoint-{name}", value)
        self.reply(result.response())


class ReplayHandler(TestCallHandler):
    @operation("replay", "Run a stored request again (marked as a test call)",
               "owner, manager, operator", schemas.TestCallResult, errors=(409, 503))
    async def post(self, guildId: str, scriptId: str, requestId: str) -> None:  # type: ignore[override]
        target, request = await self.call(testcalls.replay_request, self.actor, guildId, scriptId,
                                          requestId, plans=self.plans)
        await self.run(target, request)


routes = [
    ("/api/v1/guilds/{guildId}/scripts/{scriptId}/endpoint", EndpointHandler),
    ("/api/v1/guilds/{guildId}/scripts/{scriptId}/endpoint/secret", SecretHandler),
    ("/api/v1/guilds/{guildId}/scripts/{scriptId}/test", TestCallHandler),
    ("/api/v1/guilds/{guildId}/scripts/{scriptId}/history/{requestId}/replay", ReplayHandler),
]
