"""The journal's search for the presented secret (and for the prefixes of the
service's other secrets' and tokens' shapes): the C scan answers exactly what
the Python reference answers, and what is kept holds no secret either way.

`service.http._scan.scan` (an optional C extension) replaces the Python
`_scan` on the request path; if the two ever disagreed on a value that holds
the secret, the secret would be written to the journal and history.
"""

from __future__ import annotations

import random
import string
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from service.http import journal_facts
from service.http.journal_facts import FIELDS, _scan, without_secret
from service.http.redaction import SHAPE_PREFIXES

pytestmark = pytest.mark.skipif(journal_facts._fast_scan is None,
                                reason="service.http._scan not built (no C compiler at install)")

_ALPHABET = string.ascii_letters + string.digits + "-_"


def _secret(rng: random.Random) -> str:
    return "lsk_" + "".join(rng.choice(_ALPHABET) for _ in range(43))


def _piece(rng: random.Random, needle: str) -> str:
    """A bit of text: plain, one to four bytes per character, an encoding's
    mark, or the secret as it is, in another letter case, encoded or nearly."""
    kind = rng.randrange(95)
    if kind == 0:
        return needle
    if kind == 1:
        return needle.upper() if rng.random() < 0.5 else needle.swapcase()
    if kind == 2:
        return needle[:-1] + ("A" if needle[-1] != "A" else "B")  # one character off
    if kind == 3:
        return "".join(f"%{ord(c):02X}" if rng.random() < 0.3 else c for c in needle)
    if kind == 4:
        return "".join(f"\\u{ord(c):04x}" if rng.random() < 0.3 else c for c in needle)
    if kind == 5:
        return rng.choice(["%", "\\", "%41", "\\n", "100%"])
    if kind == 6:
        return rng.choice(["é", "ÿ", "µ", "café"])              # Latin-1: one byte each
    if kind == 7:
        return rng.choice(["ж", "€", "日本"])                   # two bytes each
    if kind == 8:
        return rng.choice(["😀", "𝔘"])                           # four bytes each
    if kind == 9:
        # Letters that Python lowers to ASCII ones (KELVIN SIGN -> "k"),
        # in place of theirs in the secret: a header name holds it then.
        return needle.replace("k", "\u212a").replace("K", "\u212a")
    if kind == 10:
        return needle[: rng.randrange(1, len(needle))]
    if kind == 11:
        # UTF-16 read as one byte a character (a percent-decoded query value)
        return "".join(c + "\x00" for c in needle) if rng.random() < 0.5 else "a\x00b"
    if kind in (12, 13):
        # A shape's prefix (another secret, a token, a login link, a session
        # cookie) in any letter case, whole, cut short or interrupted; or
        # with a letter Python lowers to ASCII (KELVIN SIGN).
        prefix = rng.choice(SHAPE_PREFIXES)
        prefix = "".join(c.upper() if rng.random() < 0.4 else c for c in prefix)
        form = rng.randrange(5)
        if form == 1:
            prefix = prefix[:rng.randrange(1, len(prefix))]
        elif form == 2:
            at = rng.randrange(1, len(prefix))
            prefix = prefix[:at] + rng.choice(["é", "ж", "😀", " "]) + prefix[at:]
        elif form == 3:
            prefix = prefix.replace("k", "\u212a").replace("K", "\u212a")
        return prefix + rng.choice(["", "x" * 43, "/"])
    return "".join(rng.choice(string.ascii_letters + " -_./:") for _ in range(rng.randrange(12)))


def _text(rng: random.Random, needle: str, pieces: int = 3) -> str:
    return "".join(_piece(rng, needle) for _ in range(rng.randrange(pieces + 1)))


def _body(rng: random.Random, needle: str) -> Any:
    text = _text(rng, needle, 4)
    form = rng.randrange(6)
    if form == 0:
        return text                                   # kept as text by an older entry
    if form == 1:
        return text.encode("utf-16-le")               # NUL bytes
    if form == 2:
        return text.encode("utf-8") + b"\x00"
    return text.encode("utf-8", "surrogatepass")


def _facts(rng: random.Random, needle: str) -> tuple[Any, ...]:
    facts: dict[str, Any] = {name: None for name in FIELDS}
    query: dict[str, Any] = {}
    for _ in range(rng.randrange(4)):
        name = _text(rng, needle, 2)
        query[name] = ([_text(rng, needle) for _ in range(rng.randrange(1, 4))]
                       if rng.random() < 0.3 else _text(rng, needle))
    headers = {_text(rng, needle, 2).lower(): _text(rng, needle) for _ in range(rng.randrange(5))}
    pair = list if rng.random() < 0.5 else tuple  # as sent, or as read back from the journal
    response_headers = [pair((_text(rng, needle, 2), _text(rng, needle)))
                        for _ in range(rng.randrange(5))]
    facts.update(
        endpoint_id=1, keep=10, error_logs=True, accepted=True, request_id="req_1", started=1.0,
        finished=1.5, status=200, ip="127.0.0.1", method="POST", query=query, headers=headers,
        body=_body(rng, needle), user_agent=_text(rng, needle) if rng.random() < 0.3 else "",
        response_headers=response_headers, response_body=_body(rng, needle),
        output=_text(rng, needle) if rng.random() < 0.3 else "",
        error=_text(rng, needle) if rng.random() < 0.2 else None,
        error_message=_text(rng, needle) if rng.random() < 0.2 else "",
        traceback=_text(rng, needle) if rng.random() < 0.2 else None,
    )
    if not isinstance(facts["response_body"], bytes):  # always bytes, as sent
        facts["response_body"] = facts["response_body"].encode("utf-8", "surrogatepass")
    return tuple(facts.values())


def test_the_c_scan_answers_what_the_python_scan_answers() -> None:
    """20,000 generated requests: the secret (or its random part) as it is, in
    another case, encoded, one character off, cut short, among text of every
    width, in every name and value the journal keeps."""
    rng = random.Random(20261129)
    seen: dict[tuple[bool, bool, bool], int] = {}
    for _ in range(20_000):
        needle = _secret(rng)
        if rng.random() < 0.5:
            needle = needle[4:]  # the random part, as `without_secret` looks for it
        facts = _facts(rng, needle)
        expected = _scan(needle, facts)
        assert journal_facts._fast_scan(needle, needle.lower(), facts) == expected, facts
        seen[expected] = seen.get(expected, 0) + 1
    # Every answer occurs often: neither scan can pass by answering one thing.
    assert all(seen.get(answer, 0) > 250 for answer in
               [(found, marked, shaped) for found in (False, True) for marked in (False, True)
                for shaped in (False, True)]), seen


@pytest.mark.parametrize("where", ["header value", "header name (upper case)",
                                   "response header name", "long response header name",
                                   "query name", "repeated query value",
                                   "body", "response body", "output", "traceback"])
def test_each_place_is_searched(where: str) -> None:
    secret = _secret(random.Random(where))
    needle = secret[4:]
    facts = dict(zip(FIELDS, _facts(random.Random(0), "unrelated")))
    facts.update(query={"q": "1"}, headers={"content-type": "application/json"},
                 body=b'{"a": 1}', response_headers=[("Content-Type", "application/json")],
                 response_body=b"{}", output="", error=None, error_message="", traceback=None,
                 user_agent="")
    plain = tuple(facts.values())
    assert journal_facts._fast_scan(needle, needle.lower(), plain) == (False, False, False)
    if where == "header value":
        facts["headers"] = {"x-forward": f"Bearer {secret}"}
    elif where == "header name (upper case)":
        facts["headers"] = {f"x-{needle.upper()}": "1"}
    elif where == "response header name":
        facts["response_headers"] = [(f"X-{needle.swapcase()}", "1")]
    elif where == "long response header name":  # lowered in a buffer of its own
        facts["response_headers"] = [("X-" + "a" * 600 + needle.upper() + "b" * 5000, "1")]
    elif where == "query name":
        facts["query"] = {secret: "1"}
    elif where == "repeated query value":
        facts["query"] = {"q": ["1", f"v{needle}"]}
    elif where == "body":
        facts["body"] = b'{"s": "' + secret.encode() + b'"}'
    elif where == "response body":
        facts["response_body"] = secret.encode()
    elif where == "output":
        facts["output"] = f"got {secret}\n"
    else:
        facts["traceback"] = f"ValueError: {secret}"
    held = tuple(facts.values())
    # (shaped too where the whole secret, its prefix with it, was placed)
    assert journal_facts._fast_scan(needle, needle.lower(), held)[:2] == (True, False)
    kept = msgpack.packb(without_secret(held, secret), use_bin_type=True)
    assert needle.encode() not in kept.lower() and needle.lower().encode() not in kept.lower()


@pytest.mark.parametrize("where", ["header value", "header name", "response header name",
                                   "response header value", "query name", "repeated query value",
                                   "body", "response body", "output", "wide output", "error"])
@pytest.mark.parametrize("prefix", ["LSK_", "lat_", "Login/", "logic_session"])
def test_each_place_is_searched_for_a_shapes_prefix(where: str, prefix: str) -> None:
    """Another secret's or token's prefix in any place: `shaped`, and only there."""
    needle = _secret(random.Random(where))[4:]
    facts = dict(zip(FIELDS, _facts(random.Random(0), "unrelated")))
    facts.update(query={"q": "1"}, headers={"content-type": "application/json"},
                 body=b'{"a": 1}', response_headers=[("Content-Type", "application/json")],
                 response_body=b"{}", output="", error=None, error_message="", traceback=None,
                 user_agent="")
    assert journal_facts._fast_scan(needle, needle.lower(), tuple(facts.values()))[2] is False
    held = f"x {prefix}y"
    if where == "header value":
        facts["headers"] = {"x-fallback": held}
    elif where == "header name":
        facts["headers"] = {f"x-{held.lower()}": "1"}
    elif where == "response header name":
        facts["response_headers"] = [(held, "1")]
    elif where == "response header value":
        facts["response_headers"] = [("X-A", held)]
    elif where == "query name":
        facts["query"] = {held: "1"}
    elif where == "repeated query value":
        facts["query"] = {"q": ["1", held]}
    elif where == "body":
        facts["body"] = held.encode()
    elif where == "response body":
        facts["response_body"] = held.encode()
    elif where == "output":
        facts["output"] = held
    elif where == "wide output":
        facts["output"] = "😀 " + held
    else:
        facts["error"] = held
    assert journal_facts._fast_scan(needle, needle.lower(), tuple(facts.values())) == (
        False, False, True)


def test_a_shape_it_does_not_know_is_left_to_python() -> None:
    secret = _secret(random.Random(1))
    needle = secret[4:]
    facts = dict(zip(FIELDS, _facts(random.Random(2), needle)))
    facts["headers"] = {"x-n": 12}                      # not text
    odd = tuple(facts.values())
    assert journal_facts._fast_scan(needle, needle.lower(), odd) is None
    assert journal_facts._fast_scan("sécret-" * 8, "sécret-" * 8, odd) is None  # not ASCII
    assert journal_facts._fast_scan(needle, needle, odd) is None    # not it in lower case

    class Name(str):  # its own methods: what Python's joins would call, the C scan cannot
        def lower(self) -> str:
            return "x"
    facts["headers"] = {Name("x-é"): "1"}
    assert journal_facts._fast_scan(needle, needle.lower(), tuple(facts.values())) is None
    facts["headers"] = {"x-n": "12"}
    facts["query"] = {"a": f"{secret}"}
    facts["response_headers"] = [("X-A", "1", "extra")]  # not a pair
    assert journal_facts._fast_scan(needle, needle.lower(), tuple(facts.values())) is None
    facts["response_headers"] = []
    facts["query"] = {"a": ["1", 2]}                     # a repeated value that is not text
    facts["body"] = f"x {secret}"
    unknown = tuple(facts.values())
    assert journal_facts._fast_scan(needle, needle.lower(), unknown) is None
    # ... and `without_secret` still redacts it (with the Python scan).
    kept = without_secret(unknown, secret)
    assert secret not in str(kept) and needle not in str(kept)


def test_without_secret_keeps_the_same_with_either_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(7)
    cases = []
    for _ in range(2_000):
        secret = _secret(rng)
        cases.append((secret, _facts(rng, secret[4:] if rng.random() < 0.7 else secret)))
    fast = [without_secret(facts, secret) for secret, facts in cases]
    monkeypatch.setattr(journal_facts, "_fast_scan", None)
    slow = [without_secret(facts, secret) for secret, facts in cases]
    assert fast == slow
    changed = sum(kept is not facts for kept, (_, facts) in zip(fast, cases))
    assert 200 < changed < 2_000  # many held the secret, not all
