"""What history and the records journal keep of a request, each against a real
`logic serve` (secrets review): credential names as header names
arrive (lower-cased).
"""

from __future__ import annotations

import json
import re

from tests.service.http.harness import Server, wait_until

REPLY_OK = """
on endpoint(event):
    event.reply("ok")
"""


def test_credential_words_inside_lower_cased_names_are_redacted(server: Server, make_endpoint,
                                                                 read_history) -> None:
    """`X-AuthToken` arrives as `x-authtoken`, one word: a credential word inside
    a name counts (`token`, `secret`...; a word ending in `key`), while names
    that only look alike (`keywords`, `author`, `x-keyboard-layout`) are kept."""
    ep = make_endpoint(source=REPLY_OK)
    sent = {"X-AuthToken": "CRED1", "X-ClientSecret": "CRED2", "X-AccessToken": "CRED3",
            "X-AccessKey": "CRED4", "X-Api-Key": "CRED7", "X-Keyboard-Layout": "dvorak",
            "X-Request-Source": "shop"}
    resp = server.request(f"{ep.path}?clientsecret=CRED5&apitoken=CRED6&keywords=shoes"
                          "&author=ann&page=2", body=b"{}", secret=ep.secret,
                          headers={"Content-Type": "application/json", **sent})
    assert resp.status == 200, resp.body
    assert wait_until(lambda: len(read_history(ep)) == 1)
    record = read_history(ep)[0]
    for name in ("x-authtoken", "x-clientsecret", "x-accesstoken", "x-accesskey", "x-api-key"):
        assert record["headers"][name] == "[redacted]", name
    for name in ("clientsecret", "apitoken"):
        assert record["query"][name] == "[redacted]", name
    assert record["headers"]["x-keyboard-layout"] == "dvorak"
    assert record["headers"]["x-request-source"] == "shop"
    assert record["headers"]["content-type"] == "application/json"
    assert record["query"] == {"clientsecret": "[redacted]", "apitoken": "[redacted]",
                               "keywords": "shoes", "author": "ann", "page": "2"}
    assert not re.search(r"CRED\d", json.dumps(record))
