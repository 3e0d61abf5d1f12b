"""The service-layer rules the chat command adds: a member's own login link, audit "via"."""
from __future__ import annotations

from typing import Any

import pytest

from service import core
from service.core.access import Actor
from service.core.member_links import member_login_link
from tests.factories import MANAGER, OPERATOR, OWNER, STRANGER, make_guild, make_script


def test_owner_and_manager_get_their_own_link_audited_as_themselves(db: Any) -> None:
    gid = make_guild()
    for actor in (Actor.user("100", via="chat"), Actor.user("200", via="chat")):
        link = member_login_link(actor, gid, "https://logic.example")
        token = link["url"].rsplit("/", 1)[1]
        assert link["userId"] == actor.user_id
        assert core.consume_login_token(token) == actor.user_id
    audit = core.audit_log(OPERATOR, gid)["audit"]
    links = [(r["actor"], r["detail"]["user"], r["detail"]["via"]) for r in audit
             if r["action"] == "login_link.created"]
    assert sorted(links) == [("user:100", "100", "chat"), ("user:200", "200", "chat")]


def test_strangers_the_operator_and_unknown_guilds_are_refused(db: Any) -> None:
    gid = make_guild()
    # A stranger learns nothing: the guild answers as if it did not exist.
    with pytest.raises(core.NotFoundError) as stranger:
        member_login_link(STRANGER, gid, "https://logic.example")
    assert stranger.value.code == "guild_not_found"
    with pytest.raises(core.PermissionDeniedError):
        member_login_link(OPERATOR, gid, "https://logic.example")
    with pytest.raises(core.NotFoundError) as err:
        member_login_link(OWNER, "999999999", "https://logic.example")
    assert err.value.code == "guild_not_found"
    # The operator's own function keeps auditing the operator, with no "via".
    core.create_login_link(OPERATOR, "300", "https://logic.example")
    records = [r for r in core.audit_log(OPERATOR, gid)["audit"]
               if r["action"] == "login_link.created"]
    assert records == []


def test_via_is_kept_in_the_audit_detail_only_when_named(db: Any) -> None:
    gid = make_guild()
    sid = make_script(gid)
    core.enable_endpoint(Actor.user("200", via="chat"), gid, sid)
    core.disable_endpoint(MANAGER, gid, sid)
    audit = core.audit_log(OWNER, gid)["audit"]
    assert [(r["action"], r["actor"], r["detail"]) for r in audit[:2]] == [
        ("endpoint.disabled", "user:200", {"old": True, "new": False}),
        ("endpoint.enabled", "user:200", {"old": False, "new": True, "via": "chat"})]
