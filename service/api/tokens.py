"""API tokens and dashboard login links (operator only), and the OpenAPI document."""
from __future__ import annotations

from service.api import schemas
from service.api.base import ApiError, APIHandler
from service.api.spec import operation
from service.core import tokens


class TokensHandler(APIHandler):
    @operation("createToken", "Create an API token for a user or the operator; shown only now",
               "operator", schemas.NewToken, status=201, body=schemas.TokenCreate,
               response_headers={"Cache-Control": "no-store"},
               links={"revokeToken": ("revokeToken", {"tokenId": "$response.body#/id"})})
    async def post(self) -> None:
        b = self.body(schemas.TokenCreate)
        if b.operator == (b.userId is not None):
            raise ApiError(400, "invalid_input", 'give exactly one of "userId" or "operator": true')
        self.set_header("Cache-Control", "no-store")
        self.reply(await self.call(tokens.create_api_token, self.actor, b.userId,
                                   expires_at=b.expiresAt), 201)


class TokenHandler(APIHandler):
    @operation("revokeToken", "Revoke a token: it stops working at once, on every node",
               "operator", schemas.Revoked)
    async def delete(self, tokenId: str) -> None:
        token_id = await self.call(tokens.revoke_api_token, self.actor, tokenId)
        self.api.tokens.clear()     # this node at once; the others by notification
        self.reply({"id": token_id, "revoked": True})


class LoginLinksHandler(APIHandler):
    @operation("createLoginLink", "A one-time dashboard login link for a user", "operator",
               schemas.LoginLink, status=201, body=schemas.LoginLinkCreate,
               response_headers={"Cache-Control": "no-store"})
    async def post(self) -> None:
        b = self.body(schemas.LoginLinkCreate)
        self.set_header("Cache-Control", "no-store")
        self.reply(await self.call(tokens.create_login_link, self.actor, b.userId,
                                   self.base_url), 201)


class OpenApiHandler(APIHandler):
    public = True
    #: The document, serialised once (service.api.routes): serialising its
    #: ~64 KB took ~2 ms of the event loop per request.
    document_json: bytes = b"{}"

    @operation("getOpenApi", "This document", "anyone", None, public=True, tag="meta")
    async def get(self) -> None:
        self.set_header("Cache-Control", "no-cache")
        self.set_header("Content-Type", "application/json")
        self.finish(self.document_json)


routes = [
    ("/api/v1/tokens", TokensHandler),
    ("/api/v1/tokens/{tokenId}", TokenHandler),
    ("/api/v1/login-links", LoginLinksHandler),
    ("/api/v1/openapi.json", OpenApiHandler),
]
