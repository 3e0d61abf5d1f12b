"""`/logic` against a real `logic serve`, the platform played by a real Ed25519 key pair."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from nacl.signing import SigningKey

from tests.service.chat.conftest import (MANAGER, OWNER, STRANGER, Guild, Platform,
                                         start_chat_server)
from tests.service.http.conftest import Env
from tests.service.http.harness import Response

EPHEMERAL = 64


def message(resp: Response) -> tuple[str, bool]:
    """(content, ephemeral) of a type-4 reply, after checking its shape."""
    assert resp.status == 200
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json
    assert body["type"] == 4
    assert body["data"]["allowed_mentions"] == {"parse": []}
    flags = body["data"].get("flags", 0)
    return body["data"]["content"], bool(flags & EPHEMERAL)


def audit(http_env: Any, guild_id: str) -> list[dict[str, Any]]:
    from service.core import audit_log
    from service.core.access import Actor
    return list(audit_log(Actor.operator(), guild_id)["audit"])


def test_ping_is_answered_pong(platform: Platform) -> None:
    resp = platform.send({"id": "1", "application_id": "2", "type": 1, "token": "t", "version": 1})
    assert resp.status == 200
    assert resp.json == {"type": 1}


# ------------------------------------------------------------- every subcommand, every role

def test_list_as_owner_manager_and_stranger(platform: Platform, make_guild: Any) -> None:
    g: Guild = make_guild()
    for user in (OWNER, MANAGER):
        content, ephemeral = message(platform.command("logic", "script", "list",
                                                      guild_id=g.guild_id, user_id=user))
        assert ephemeral
        assert f"`{g.script_id}`: endpoint on" in content
        assert f"`{g.other_id}`: endpoint off" in content
    content, ephemeral = message(platform.command("logic", "script", "list",
                                                  guild_id=g.guild_id, user_id=STRANGER))
    assert ephemeral and content.startswith("Not allowed")
    assert g.script_id not in content and g.name not in content


def test_show_by_name_or_id(platform: Platform, make_guild: Any, bind: Any) -> None:
    g: Guild = make_guild()
    for user, script in ((OWNER, g.name), (MANAGER, g.script_id)):
        content, ephemeral = message(platform.command("logic", "script", "show",
                                                      guild_id=g.guild_id, user_id=user,
                                                      script=script))
        assert ephemeral
        assert f"<https://logic.example.com/endpoints/{g.guild_id}/{g.script_id}>" in content
        assert "Endpoint: on" in content and "Secret: none yet" in content
        assert "IP whitelist: none" in content
    content, ephemeral = message(platform.command("logic", "script", "show", guild_id=g.guild_id,
                                                  user_id=STRANGER, script=g.script_id))
    assert ephemeral and content.startswith("Not allowed") and "URL" not in content
    content, ephemeral = message(platform.command("logic", "script", "show", guild_id=g.guild_id,
                                                  user_id=OWNER, script="no-such-script"))
    assert ephemeral and content.startswith("Not found")


@pytest.mark.parametrize("user", [OWNER, MANAGER])
def test_enable_and_disable_are_public_and_audited_as_chat(platform: Platform, make_guild: Any,
                                                           http_env: Any, bind: Any,
                                                           user: str) -> None:
    g: Guild = make_guild(enabled=False)
    content, ephemeral = message(platform.command("logic", "script", "enable", guild_id=g.guild_id,
                                                  user_id=user, script=g.script_id))
    assert not ephemeral, "enable answers in the channel"
    assert "is now **on**" in content
    content, ephemeral = message(platform.command("logic", "script", "disable",
                                                  guild_id=g.guild_id, user_id=user,
                                                  script=g.name))
    assert not ephemeral and "is now **off**" in content
    bind()
    records = audit(http_env, g.guild_id)
    switched = [r for r in records if r["action"] in ("endpoint.enabled", "endpoint.disabled")]
    assert [r["action"] for r in switched] == ["endpoint.disabled", "endpoint.enabled"]
    for r in switched:
        assert r["actor"] == f"user:{user}"
        assert r["detail"]["via"] == "chat"
        assert r["logicScriptId"] == g.script_id


def test_a_name_that_looks_like_a_link_is_not_one_in_the_channel(
        platform: Platform, make_guild: Any, bind: Any) -> None:
    # Review, session 27: enable posted **https://evil.example/claim** under the
    # application's name, a clickable link; a name typed decomposed is found.
    from service.core import scripts
    from service.core.access import Actor
    g: Guild = make_guild(enabled=False)
    bind()
    scripts.update_script(Actor.user(OWNER), g.guild_id, g.script_id,
                          name="https://evil.example/claim-\u00e9")
    content, ephemeral = message(platform.command(
        "logic", "script", "enable", guild_id=g.guild_id, user_id=OWNER,
        script="https://evil.example/claim-e\u0301"))
    assert not ephemeral and "is now **on**" in content
    assert "://" not in content and "https:\u200b//evil.example/claim-\u00e9" in content


def test_a_name_stored_decomposed_before_normalising_is_found(
        platform: Platform, make_guild: Any, bind: Any) -> None:
    # Second pass of the review, session 27: a name stored decomposed by an
    # earlier release was found neither as stored nor as typed composed.
    from models import Script
    g: Guild = make_guild()
    bind()
    Script.update(name="cafe\u0301-prod").where(Script.public_id == g.script_id).execute()
    for typed in ("cafe\u0301-prod", "caf\u00e9-prod", "CAF\u00c9-PROD"):
        content, ephemeral = message(platform.command("logic", "script", "show",
                                                      guild_id=g.guild_id, user_id=OWNER,
                                                      script=typed))
        assert g.script_id in content, (typed, content)


def test_enable_and_disable_refused_to_a_stranger(platform: Platform, make_guild: Any,
                                                  http_env: Any, bind: Any) -> None:
    g: Guild = make_guild(enabled=False)
    for sub in ("enable", "disable"):
        content, ephemeral = message(platform.command("logic", "script", sub, guild_id=g.guild_id,
                                                      user_id=STRANGER, script=g.script_id))
        assert ephemeral and content.startswith("Not allowed")
    bind()
    assert not [r for r in audit(http_env, g.guild_id) if r["action"].startswith("endpoint.")]


def test_secret_only_for_the_owner_ephemeral_and_live_at_once(platform: Platform, make_guild: Any
                                                              ) -> None:
    g: Guild = make_guild()
    secrets = []
    for _ in range(2):
        content, ephemeral = message(platform.command("logic", "script", "secret",
                                                      guild_id=g.guild_id, user_id=OWNER,
                                                      script=g.script_id))
        assert ephemeral, "a secret is only ever sent in an ephemeral reply"
        found = re.findall(r"`(lsk_[A-Za-z0-9_-]{43})`", content)
        assert len(found) == 1 and "previous secret" in content
        secrets.append(found[0])
    old, new = secrets
    invoke = f"/endpoints/{g.guild_id}/{g.script_id}"
    ok = platform.server.request(invoke, json_body={"n": 1}, secret=new)
    assert ok.status == 200 and ok.json == {"ok": True, "body": {"n": 1}}
    refused = platform.server.request(invoke, json_body={"n": 1}, secret=old)
    assert refused.status == 401 and refused.code == "unauthorized"
    for user in (MANAGER, STRANGER):
        content, ephemeral = message(platform.command("logic", "script", "secret",
                                                      guild_id=g.guild_id, user_id=user,
                                                      script=g.script_id))
        assert ephemeral and content.startswith("Not allowed") and "lsk_" not in content
    assert platform.server.request(invoke, json_body={}, secret=new).status == 200
    assert "lsk_" not in platform.server.log


def test_whitelist_set_and_cleared(platform: Platform, make_guild: Any) -> None:
    g: Guild = make_guild()
    for user in (OWNER, MANAGER):
        content, ephemeral = message(platform.command(
            "logic", "script", "whitelist", guild_id=g.guild_id, user_id=user,
            script=g.script_id, cidrs="10.0.0.0/8, 2001:DB8::/32 192.0.2.7"))
        assert ephemeral
        assert "`10.0.0.0/8`, `192.0.2.7/32`, `2001:db8::/32`" in content
    content, _ = message(platform.command("logic", "script", "whitelist", guild_id=g.guild_id,
                                          user_id=OWNER, script=g.script_id, cidrs="10.0.0.1/8"))
    assert "host bits set" in content and "10.0.0.0/8" in content
    content, _ = message(platform.command("logic", "script", "whitelist", guild_id=g.guild_id,
                                          user_id=MANAGER, script=g.script_id, cidrs="none"))
    assert "cleared" in content
    content, ephemeral = message(platform.command("logic", "script", "whitelist",
                                                  guild_id=g.guild_id, user_id=STRANGER,
                                                  script=g.script_id, cidrs="10.0.0.0/8"))
    assert ephemeral and content.startswith("Not allowed")


def test_history_and_stats(platform: Platform, make_guild: Any) -> None:
    from tests.service.http.harness import wait_until
    g: Guild = make_guild()
    content, _ = message(platform.command("logic", "script", "secret", guild_id=g.guild_id,
                                          user_id=OWNER, script=g.script_id))
    secret = re.findall(r"`(lsk_[A-Za-z0-9_-]{43})`", content)[0]
    invoke = f"/endpoints/{g.guild_id}/{g.script_id}"
    ids = [platform.server.request(invoke, json_body={"i": i}, secret=secret).headers["x-request-id"]
           for i in range(7)]

    def history(user: str) -> tuple[str, bool]:
        return message(platform.command("logic", "script", "history", guild_id=g.guild_id,
                                        user_id=user, script=g.script_id))

    assert wait_until(lambda: ids[-1] in history(OWNER)[0], timeout=15)
    for user in (OWNER, MANAGER):
        content, ephemeral = history(user)
        assert ephemeral, "history is only ever sent in an ephemeral reply"
        assert "Last 5 request(s)" in content
        assert [i for i in ids if i in content] == ids[2:], "the last five"
        assert content.index(ids[-1]) < content.index(ids[2]), "newest first"
        assert "POST **200**" in content
        content, ephemeral = message(platform.command("logic", "script", "stats",
                                                      guild_id=g.guild_id, user_id=user,
                                                      script=g.script_id))
        assert ephemeral
        assert re.search(r"Requests: 7 \(last 24 h: 7\); by status: 200: 7", content), content
        assert "Latency over 24 h (within 1 %): p50" in content and "`127.0.0.1` (7)" in content
    for sub in ("history", "stats"):
        content, ephemeral = message(platform.command("logic", "script", sub, guild_id=g.guild_id,
                                                      user_id=STRANGER, script=g.script_id))
        assert ephemeral and content.startswith("Not allowed") and ids[0] not in content


def test_dashboard_link_is_ephemeral_and_works_once(platform: Platform, make_guild: Any,
                                                    http_env: Any, bind: Any) -> None:
    from service.core import consume_login_token
    from service.core.errors import NotFoundError
    g: Guild = make_guild()
    for user in (OWNER, MANAGER):
        content, ephemeral = message(platform.command("logic", "dashboard", guild_id=g.guild_id,
                                                      user_id=user))
        assert ephemeral, "a login link is only ever sent in an ephemeral reply"
        token = re.findall(r"<https://logic\.example\.com/login/([A-Za-z0-9_-]+)>", content)[0]
        bind()
        assert consume_login_token(token) == user
        with pytest.raises(NotFoundError):
            consume_login_token(token)
    content, ephemeral = message(platform.command("logic", "dashboard", guild_id=g.guild_id,
                                                  user_id=STRANGER))
    assert ephemeral and content.startswith("Not allowed") and "/login/" not in content
    links = [r for r in audit(http_env, g.guild_id) if r["action"] == "login_link.created"]
    assert {(r["actor"], r["detail"]["via"]) for r in links} == {
        (f"user:{OWNER}", "chat"), (f"user:{MANAGER}", "chat")}


# ------------------------------------------------------------- where, what, and the plan

def test_free_plan_guild(platform: Platform, make_guild: Any) -> None:
    g: Guild = make_guild(plan="free", enabled=False)
    content, _ = message(platform.command("logic", "script", "list", guild_id=g.guild_id,
                                          user_id=OWNER))
    assert f"`{g.script_id}`: endpoint off" in content
    content, ephemeral = message(platform.command("logic", "script", "enable", guild_id=g.guild_id,
                                                  user_id=OWNER, script=g.script_id))
    assert ephemeral
    assert content.startswith("Refused by the plan")
    # A plan without endpoints says so (it said "allows 0 enabled endpoint(s)").
    assert "plan free does not include endpoints" in content
    content, _ = message(platform.command("logic", "script", "whitelist", guild_id=g.guild_id,
                                          user_id=OWNER, script=g.script_id, cidrs="10.0.0.0/8"))
    assert "does not include an IP whitelist" in content


def test_plus_plan_quota_refusal_names_the_numbers(platform: Platform, make_guild: Any,
                                                   bind: Any, http_env: Any) -> None:
    from service.core import create_script
    from service.core.access import Actor
    g: Guild = make_guild(plan="plus")
    bind()
    extra = [create_script(Actor.user(OWNER), g.guild_id, f"x{i}", "x = 1\n")["logicScriptId"]
             for i in range(3)]
    for script_id in [g.other_id, extra[0]]:
        content, _ = message(platform.command("logic", "script", "enable", guild_id=g.guild_id,
                                              user_id=OWNER, script=script_id))
        assert "is now **on**" in content
    content, _ = message(platform.command("logic", "script", "enable", guild_id=g.guild_id,
                                          user_id=OWNER, script=extra[1]))
    assert f"plan plus allows 3 enabled endpoint(s) and guild {g.guild_id} has 3" in content


def test_direct_message_and_unknown_guild(platform: Platform) -> None:
    content, ephemeral = message(platform.command("logic", "script", "list", guild_id=None,
                                                  user_id=OWNER))
    assert ephemeral and content.startswith("Use /logic in a server")
    content, ephemeral = message(platform.command("logic", "script", "list",
                                                  guild_id="123456789012345678", user_id=OWNER))
    assert ephemeral and "not registered with Logic Endpoints" in content


def test_unknown_subcommand(platform: Platform, make_guild: Any) -> None:
    g: Guild = make_guild()
    for path in (("logic", "script", "explode"), ("logic", "nothing"), ("other",)):
        content, ephemeral = message(platform.command(*path, guild_id=g.guild_id, user_id=OWNER))
        assert ephemeral and content.startswith("Unknown command /" + " ".join(path))
        assert "logic chat commands --json" in content


def test_autocomplete(platform: Platform, make_guild: Any) -> None:
    g: Guild = make_guild()
    resp = platform.autocomplete("logic", "script", "show", guild_id=g.guild_id, user_id=MANAGER,
                                 typed="alp")
    assert resp.status == 200 and resp.json["type"] == 8
    assert resp.json["data"]["choices"] == [{"name": f"{g.name} ({g.script_id})",
                                             "value": g.script_id}]
    resp = platform.autocomplete("logic", "script", "show", guild_id=g.guild_id, user_id=OWNER,
                                 typed="")
    assert [c["value"] for c in resp.json["data"]["choices"]] == [g.script_id, g.other_id]
    resp = platform.autocomplete("logic", "script", "stats", guild_id=g.guild_id, user_id=STRANGER,
                                 typed="")
    assert resp.json == {"type": 8, "data": {"choices": []}}


def test_replayed_interaction_is_refused(platform: Platform, make_guild: Any) -> None:
    g: Guild = make_guild()
    payload = platform.interaction(2, guild_id=g.guild_id, user_id=OWNER,
                                   path=("logic", "script", "list"))
    body = json.dumps(payload).encode()
    headers = platform.headers(body)
    assert platform.post(body, headers).status == 200
    again = platform.post(body, headers)
    assert again.status == 401 and again.code == "unauthorized"


def test_a_replay_sent_to_another_process_or_after_a_restart_is_refused(
        http_env: Env, tmp_path: Path, make_guild: Any) -> None:
    """Two front processes on one database, then one of them restarted: the signed
    request that regenerated the owner's secret is refused everywhere after its first
    answer, and the secret it made is still the one in force."""
    from models import Endpoint
    g: Guild = make_guild()
    key = SigningKey.generate()
    first = start_chat_server(http_env, tmp_path, key)
    second = start_chat_server(http_env, tmp_path, key)
    servers = [first, second]
    try:
        one, two = Platform(first, key), Platform(second, key)
        payload = one.interaction(2, guild_id=g.guild_id, user_id=OWNER,
                                  path=("logic", "script", "secret"), options={"script": g.name})
        body = json.dumps(payload).encode()
        headers = one.headers(body)
        answered = one.post(body, headers)
        assert answered.status == 200 and "lsk_" in answered.json["data"]["content"]
        hint = Endpoint.get(Endpoint.script_id == _script_pk(g)).secret_hint
        assert hint and answered.json["data"]["content"].count(hint) >= 1
        again = two.post(body, headers)
        assert again.status == 401 and again.code == "unauthorized"
        first.stop()
        servers.remove(first)
        restarted = start_chat_server(http_env, tmp_path, key)
        servers.append(restarted)
        after = Platform(restarted, key).post(body, headers)
        assert after.status == 401 and after.code == "unauthorized"
        assert Endpoint.get(Endpoint.script_id == _script_pk(g)).secret_hint == hint
    finally:
        for srv in servers:
            srv.stop()


def _script_pk(g: Guild) -> int:
    from models import Script
    return int(Script.get(Script.public_id == g.script_id).id)


def test_signed_garbage_is_400(platform: Platform) -> None:
    nested = b'{"type": 2, "data": ' + b"[" * 20000 + b"]" * 20000 + b"}"  # too deep to parse
    for body in (b"{not json", b"[1, 2]", b'{"type": 2}', nested):
        resp = platform.post(body, platform.headers(body))
        assert resp.status == 400 and resp.code == "invalid_body"
