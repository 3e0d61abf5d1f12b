"""Secrets and tokens a request carries besides the one it presents, as a manager
reads its history through the admin API of a real `logic serve` (security
review: another endpoint's secret, the operator's API token)."""
from __future__ import annotations

import json
import re
import secrets
from pathlib import Path

from tornado.web import create_signed_value

from tests.service.api.conftest import ECHO, assert_error
from tests.service.http.harness import wait_until


def test_other_secrets_and_tokens_a_request_carries_are_redacted(world, server) -> None:
    """Another endpoint's live secret (which a manager is refused) in a header,
    the query and the body; the operator's API token; a login link; a session
    cookie's signed value: the script prints and echoes them all, and neither
    history nor the records journal keeps any of them."""
    w = world()
    w.owner("PATCH", w.script_path + "/endpoint", {"enabled": True})
    secret = w.owner("POST", w.script_path + "/endpoint/secret").json["secret"]
    created = w.owner("POST", f"/guilds/{w.guild_id}/scripts", {"name": "other", "source": ECHO})
    assert created.status == 201, created.body
    other_path = f"/guilds/{w.guild_id}/scripts/{created.json['logicScriptId']}"
    assert w.owner("PATCH", other_path + "/endpoint", {"enabled": True}).status == 200
    other = w.owner("POST", other_path + "/endpoint/secret").json["secret"]
    assert_error(w.manager("POST", other_path + "/endpoint/secret"), 403, "owner_only")
    other_url = f"/endpoints/{w.guild_id}/{created.json['logicScriptId']}"
    assert server.request(other_url, json_body={}, secret=other).status == 200  # it is live
    operator = w.operator.token
    assert operator is not None and operator.startswith("lat_")
    link = "https://logic.example/login/" + secrets.token_urlsafe(32)
    cookie = create_signed_value("k" * 32, "logic_session", secrets.token_urlsafe(32)).decode()
    carried = {"another endpoint's secret": other[4:], "the operator's token": operator[4:],
               "a login link's token": link.rsplit("/", 1)[1],
               "a session cookie's token": cookie.split("|")[4].split(":", 1)[1]}

    resp = server.request(
        f"/endpoints/{w.guild_id}/{w.script_id}?fallback={other}&page=2", secret=secret,
        json_body={"fallback": other, "admin": operator, "link": link, "session": cookie,
                   "note": "kept as sent"},
        headers={"X-Fallback": other, "X-Admin": f"Bearer {operator}", "Referer": link,
                 "X-Sent-Session": f"logic_session={cookie}"})
    assert resp.status == 200, resp.body
    assert other.encode() in resp.body   # the script did echo them
    assert wait_until(lambda: len(w.manager("GET", w.script_path + "/history").json["items"]) == 1)
    listed = w.manager("GET", w.script_path + "/history").json["items"][0]
    full = w.manager("GET", f"{w.script_path}/history/{resp.headers['x-request-id']}")
    assert full.status == 200, full.body
    for record in (listed, full.json):
        text = json.dumps(record)
        kept = [what for what, part in carried.items() if part in text]
        assert not kept, kept   # not the values themselves: a failure would print them
        assert "kept as sent" in text and "[redacted]" in text
    record = full.json
    assert record["query"] == {"fallback": "[redacted]", "page": "2"}
    for name in ("x-fallback", "x-admin", "referer", "x-sent-session"):
        assert record["headers"][name] == "[redacted]", name
    # Nor the records journal's files: redacted before the request is journaled.
    journal = Path(re.search(r'journal = "([^"]+)"', Path(server.config or "").read_text())[1])
    segments = b"".join(p.read_bytes() for p in sorted(journal.rglob("segment-*.journal")))
    assert b"kept as sent" in segments
    kept = [what for what, part in carried.items() if part.encode() in segments]
    assert not kept, kept
