"""What history and the records journal keep of a request, each against a real
`logic serve` (secrets review): credential names as header names
arrive (lower-cased), and no more of a body, an output or a header than
history keeps is journaled, so nothing unsearched reaches the journal's files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.service.http.harness import Server, wait_until

REPLY_OK = """
on endpoint(event):
    event.reply("ok")
"""

ECHO_RAW = """
on endpoint(event):
    print(event.rawBody)
    event.header("Content-Type", "text/plain")
    event.reply(event.rawBody)
"""


def _journal_bytes(server: Server) -> bytes:
    journal = Path(re.search(r'journal = "([^"]+)"', Path(server.config or "").read_text())[1])
    return b"".join(p.read_bytes() for p in sorted(journal.rglob("segment-*.journal")))


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


def test_the_journal_keeps_no_more_than_history_of_a_long_value(server: Server, make_endpoint,
                                                                read_history) -> None:
    """The secret percent-encoded past the first 9 KiB of a body, of the script's
    output and reply, and of a header: the search for an encoded secret reads
    9 KiB of a value, so the journal keeps of a body or text only what history
    keeps (8 KB and a byte), and a header mapping with a value too long to
    search as history keeps it (too big to store: a note of its size)."""
    ep = make_endpoint(source=ECHO_RAW)
    percent = "".join("%%%02X" % ord(c) for c in ep.secret)
    start = f"from {ep.script_id} "   # finds this request's entry in the journal
    body = (start + "a" * 12_000 + " " + percent + " " + "b" * 8_000).encode()
    header = "c" * 10_000 + percent
    resp = server.request(ep.path, body=body, secret=ep.secret,
                          headers={"Content-Type": "text/plain", "X-Long": header})
    assert resp.status == 200, resp.body
    assert percent.encode() in resp.body   # the script did reply with it
    assert wait_until(lambda: len(read_history(ep)) == 1)
    record = read_history(ep)[0]
    assert record["bodyTruncated"] is True and record["body"] == body[:8192].decode()
    assert record["responseBodyTruncated"] is True
    assert record["output"].startswith(body[:8192].decode())
    assert record["output"].endswith("[truncated]")
    assert set(record["headers"]) == {"…"}   # too big to store: a note of its size
    assert percent not in json.dumps(record)
    journaled = _journal_bytes(server)
    assert start.encode() in journaled   # it was journaled
    leaked = percent.encode() in journaled   # not asserted in place: a failure would print it
    assert not leaked
    assert header.encode()[:9000] not in journaled


def test_a_name_holding_the_secret_is_judged_as_it_is_kept() -> None:
    """A secret's random characters can spell a credential word (`pwd`, a part
    ending in `Key`: 1 secret in 400): a name holding the secret is judged once
    the secret is cut out of it, so its value is kept (test_hardening's
    `test_a_secret_held_in_a_name_is_redacted_too` failed for such secrets)."""
    from service.http.journal_facts import FIELDS, without_secret

    secret = "lsk_" + "A" * 20 + "xPwd" + "B" * 14 + "-xKey"
    facts = dict.fromkeys(FIELDS)
    facts.update(accepted=True, query={secret: "1", "h": f"X-{secret}", "apiKey": "k"},
                 headers={f"x-from-{secret.lower()}": "1"}, body=b"", user_agent="",
                 response_headers=[(f"X-{secret}", "1")], response_body=b"", output="",
                 error_message="")
    kept = dict(zip(FIELDS, without_secret(tuple(facts.values()), secret)))
    assert kept["query"] == {"[redacted]": "1", "h": "[redacted]", "apiKey": "[redacted]"}
    assert kept["headers"] == {"x-from-[redacted]": "1"}
    assert kept["response_headers"] == [["X-[redacted]", "1"]]
