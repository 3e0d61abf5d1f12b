"""Authentication of /api/v1 against a real server: tokens, revocation, expiry,
acting users, throttling and the per-token rate limit."""
from __future__ import annotations

import subprocess
from datetime import datetime, timedelta, timezone

from tests.service.api.conftest import OWNER_ID, Api, assert_error
from tests.service.http.harness import LOGIC, at_once, wait_until


def test_no_or_bad_token_is_401_with_the_envelope(server, make_token, source_ip) -> None:
    ip = source_ip()
    for token in (None, "lat_nope", "lsk_not_an_api_token"):
        resp = Api(server, token, ip=ip)("GET", "/me")
        assert_error(resp, 401, "unauthorized")
        assert resp.headers["www-authenticate"] == "Bearer"
        assert "ratelimit-limit" not in resp.headers      # nothing counted before auth


def test_user_and_operator_tokens_and_acting_user(server, make_token) -> None:
    user = Api(server, make_token(OWNER_ID)["token"])
    assert user("GET", "/me").json == {"userId": OWNER_ID, "operator": False,
                                       "tokenId": user("GET", "/me").json["tokenId"],
                                       "expiresAt": None}
    op = Api(server, make_token(None)["token"])
    me = op("GET", "/me")
    assert me.status == 200 and me.json["userId"] is None and me.json["operator"] is True
    assert me.headers["ratelimit-limit"] == "600"
    assert int(me.headers["ratelimit-remaining"]) < 600
    acting = op.as_user("777")("GET", "/me").json
    assert acting["userId"] == "777" and acting["operator"] is True
    # A user token may not act for anyone else.
    assert_error(user.as_user("777")("GET", "/me"), 403, "forbidden")
    assert_error(op.as_user("bad id!")("GET", "/me"), 400, "invalid_user_id")


def test_revoked_token_stops_at_once_via_the_api(server, make_token) -> None:
    op = Api(server, make_token(None)["token"])
    victim = make_token(OWNER_ID)
    user = Api(server, victim["token"])
    assert user("GET", "/me").status == 200
    assert user("GET", "/me").status == 200        # now served from the cache
    resp = op("DELETE", f"/tokens/{victim['id']}")
    assert resp.status == 200 and resp.json == {"id": victim["id"], "revoked": True}
    assert_error(user("GET", "/me"), 401, "unauthorized")
    assert_error(op("DELETE", f"/tokens/{victim['id']}"), 404, "token_not_found")


def test_revoked_token_stops_at_once_when_revoked_elsewhere(server, make_token, http_env) -> None:
    """Revoked by another process (the CLI): the server's cache must not keep it alive."""
    victim = make_token(OWNER_ID)
    user = Api(server, victim["token"])
    assert user("GET", "/me").status == 200
    assert user("GET", "/me").status == 200
    subprocess.run([LOGIC, "--database-url", http_env.database_url, "token", "revoke",
                    str(victim["id"])], check=True, capture_output=True)
    if http_env.database_url.startswith("sqlite"):
        assert_error(user("GET", "/me"), 401, "unauthorized")   # the very next call
    else:
        # PostgreSQL: the other node hears NOTIFY on commit; allow its delivery.
        assert wait_until(lambda: user("GET", "/me").status == 401, timeout=5)


def test_expired_token_is_refused_and_expiry_is_reported(server, make_token) -> None:
    soon = datetime.now(timezone.utc) + timedelta(seconds=2)
    made = make_token(OWNER_ID, expires_at=soon)
    user = Api(server, made["token"])
    me = user("GET", "/me")
    assert me.status == 200 and me.json["expiresAt"] == made["expiresAt"]
    assert wait_until(lambda: user("GET", "/me").status == 401, timeout=10)
    op = Api(server, make_token(None)["token"])
    past = (datetime.now(timezone.utc) - timedelta(minutes=1)).isoformat()
    assert_error(op("POST", "/tokens", {"userId": "1", "expiresAt": past}), 400, "invalid_expiry")
    future = (datetime.now(timezone.utc) + timedelta(days=1)).isoformat()
    created = op("POST", "/tokens", {"userId": "1", "expiresAt": future})
    assert created.status == 201 and created.json["expiresAt"].endswith("Z")
    assert created.headers["cache-control"] == "no-store"
    assert Api(server, created.json["token"])("GET", "/me").json["userId"] == "1"


def test_last_used_is_recorded(server, make_token, bind) -> None:
    from models import ApiToken
    made = make_token(OWNER_ID)
    assert Api(server, made["token"])("GET", "/me").status == 200
    bind()
    assert wait_until(lambda: ApiToken.get_by_id(made["id"]).last_used_at is not None)


def test_failed_authentications_are_throttled_per_ip(server, make_token, source_ip) -> None:
    ip = source_ip()
    bad = Api(server, "lat_" + "x" * 43, ip=ip)
    for _ in range(20):
        assert bad("GET", "/me").status == 401
    good = Api(server, make_token(OWNER_ID)["token"], ip=ip)
    resp = good("GET", "/me")                      # even a good token waits: checked first
    assert_error(resp, 429, "auth_throttled")
    assert int(resp.headers["retry-after"]) >= 1
    assert Api(server, good.token, ip=source_ip())("GET", "/me").status == 200


def test_token_and_link_management_is_operator_only(server, make_token) -> None:
    user = Api(server, make_token(OWNER_ID)["token"])
    assert_error(user("POST", "/tokens", {"operator": True}), 403, "forbidden")
    assert_error(user("POST", "/login-links", {"userId": "1"}), 403, "forbidden")
    assert_error(user("DELETE", "/tokens/1"), 403, "forbidden")
    op = Api(server, make_token(None)["token"])
    assert_error(op("POST", "/tokens", {"userId": "1", "operator": True}), 400, "invalid_input")
    assert_error(op("POST", "/tokens", {"nope": 1}), 400, "invalid_input")
    link = op("POST", "/login-links", {"userId": "1"})
    assert link.status == 201 and "/login/" in link.json["url"] and link.json["expiresAt"]
    assert link.headers["cache-control"] == "no-store"
    made = op("POST", "/tokens", {"operator": True})
    assert made.status == 201 and made.json["kind"] == "operator"
    assert made.json["token"].startswith("lat_")


def test_revocation_reaches_every_node(make_server, make_token) -> None:
    """Two servers on one database: a token revoked through one stops on the other."""
    a, b = make_server(), make_server()
    victim = make_token(OWNER_ID)
    for node in (a, b):
        assert Api(node, victim["token"])("GET", "/me").status == 200
        assert Api(node, victim["token"])("GET", "/me").status == 200     # cached now
    op = Api(a, make_token(None)["token"])
    assert op("DELETE", f"/tokens/{victim['id']}").status == 200
    assert_error(Api(a, victim["token"])("GET", "/me"), 401, "unauthorized")
    # The other node: SQLite at once (data_version), PostgreSQL on NOTIFY delivery.
    assert wait_until(lambda: Api(b, victim["token"])("GET", "/me").status == 401, timeout=5)


def test_wrong_tokens_sent_at_once_cannot_outrun_the_throttle(server, make_token,
                                                               source_ip) -> None:
    """The lookups of an address running count with its failures: 60 wrong tokens
    sent at once from one address get at most 20 lookups (401), the rest 429; a good
    token's lookup counts nothing once it is done."""
    ip = source_ip()
    results = at_once(60, lambda n: Api(server, "lat_" + f"{n:02d}" + "x" * 41,
                                        ip=ip)("GET", "/me").status)
    assert len(results) == 60
    assert results.count(401) <= 20, sorted(results)
    assert results.count(401) + results.count(429) == 60, sorted(results)
    other = source_ip()
    for n in range(19):
        assert Api(server, "lat_" + f"{n:02d}" + "y" * 41, ip=other)("GET", "/me").status == 401
    good = make_token(OWNER_ID)["token"]          # looked up once: counted, then given back
    assert Api(server, good, ip=other)("GET", "/me").status == 200
    assert Api(server, "lat_" + "z" * 43, ip=other)("GET", "/me").status == 401
    assert_error(Api(server, "lat_" + "w" * 43, ip=other)("GET", "/me"), 429, "auth_throttled")


def test_a_client_sending_its_good_token_many_times_at_once_is_never_throttled(
        server, make_token, source_ip) -> None:
    """60 calls at once with a good token the server has not looked up yet: past 20
    at once they wait for the running lookups (which prove good, and cache it), and
    none is answered 429."""
    token = make_token(OWNER_ID)["token"]
    ip = source_ip()
    results = at_once(60, lambda n: Api(server, token, ip=ip)("GET", "/me").status)
    assert sorted(results) == [200] * 60


def test_an_operator_acting_as_a_user_is_named_in_the_audit_trail(world) -> None:
    """The owner's own regeneration and the operator's, acting as the owner, do
    the same; the audit trail tells them apart (`detail.via`)."""
    w = world()
    w.owner("PATCH", w.script_path + "/endpoint", {"enabled": True})
    assert w.owner("POST", w.script_path + "/endpoint/secret").status == 201
    acting = w.operator.as_user(OWNER_ID)
    assert acting("POST", w.script_path + "/endpoint/secret").status == 201
    records = [r for r in w.owner("GET", f"/guilds/{w.guild_id}/audit").json["items"]
               if r["action"].startswith("secret.")]
    assert [r["actor"] for r in records] == [f"user:{OWNER_ID}"] * 2
    assert [r["detail"].get("via") for r in records] == ["operator", None]   # newest first
