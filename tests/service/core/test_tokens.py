"""API tokens and one-time login links."""
from __future__ import annotations

from datetime import timedelta

import pytest

from models import ApiToken, LoginToken
from service import core
from tests.factories import OPERATOR, OWNER


def test_api_tokens_are_hashed_and_act_as_their_user(db):
    with pytest.raises(core.PermissionDeniedError):
        core.create_api_token(OWNER, "100")
    user = core.create_api_token(OPERATOR, "100")
    op = core.create_api_token(OPERATOR, None)
    assert user["token"].startswith("lat_") and user["kind"] == "user" and op["kind"] == "operator"
    stored = [t.token_hash for t in ApiToken.select()]
    assert user["token"] not in stored and all(len(h) == 64 for h in stored)
    assert core.authenticate_token(user["token"]) == core.Actor.user("100")
    op_actor = core.authenticate_token(op["token"])
    assert op_actor is not None and op_actor.is_operator
    assert core.authenticate_token("lat_nope") is None and core.authenticate_token("") is None
    core.revoke_api_token(OPERATOR, user["id"])
    assert core.authenticate_token(user["token"]) is None
    with pytest.raises(core.NotFoundError):
        core.revoke_api_token(OPERATOR, user["id"])


def test_login_link_is_single_use_and_expires(db):
    link = core.create_login_link(OPERATOR, "100", "https://logic.example/")
    token = link["url"].rsplit("/", 1)[1]
    assert link["url"] == f"https://logic.example/login/{token}"
    assert token not in [t.token_hash for t in LoginToken.select()]
    assert core.consume_login_token(token) == "100"
    with pytest.raises(core.NotFoundError) as err:
        core.consume_login_token(token)
    assert err.value.code == "invalid_login_token"
    expired = core.create_login_link(OPERATOR, "100", "http://x", ttl=timedelta(seconds=-1))
    with pytest.raises(core.NotFoundError):
        core.consume_login_token(expired["url"].rsplit("/", 1)[1])
    with pytest.raises(core.PermissionDeniedError):
        core.create_login_link(OWNER, "100", "http://x")
