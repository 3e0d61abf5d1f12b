"""What a body may hold before the service builds Python objects for it.

Review, session 28: the invoke path parses a body on the event loop before
the request is queued, and a request refused busy (or whose client leaves
while it waits) gives its quota slot back, so parsing cost was unbounded by
the rate limit: a 1 MiB form of 209,600 fields took 458 ms of the loop, a
1 MiB JSON body of empty lists 90 ms and ~28 MB while queued. A form or query
holds at most 1,000 fields and a JSON body at most 50,000 values, counted
before anything is decoded.
"""
from __future__ import annotations

import json
import random
from typing import Any

from service.http import event
from tests.service.http.harness import Server

ECHO_SIZE = """
on endpoint(event):
    body = event.body
    event.reply({"n": len(body) if body is not None else None, "q": len(event.query)})
"""


def _values(value: Any) -> int:
    """The values `json` builds for `value`, keys included."""
    if isinstance(value, list):
        return 1 + sum(_values(v) for v in value)
    if isinstance(value, dict):
        return 1 + sum(1 + _values(v) for v in value.values())
    return 1


def _document(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.random()
    if depth > 4 or pick < 0.4:
        return rng.choice([1, -2.5, True, None, "", "a,b:[{", '"\\', "é,{", "\u2028:"])
    if pick < 0.7:
        return [_document(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {f"k{i},:[\\": _document(rng, depth + 1) for i in range(rng.randint(0, 4))}


def test_the_count_is_exact_for_any_json_document_and_the_c_twin_agrees() -> None:
    rng = random.Random(28)
    for n in range(2000):
        value = _document(rng)
        for indent in (None, 2):
            text = json.dumps(value, indent=indent, ensure_ascii=n % 2 == 0)
            assert event.json_values(text) == event.json_values_py(text) == _values(value), text
    for text in ('"open', '[1, "x\\', "[ ]", "{ }", "[[ ],[1]]", "", " 1 "):
        assert event.json_values(text) == event.json_values_py(text)


def _post(server: Server, ep: Any, body: str, content_type: str, query: str = "") -> Any:
    return server.request(ep.path + query, body=body.encode(), secret=ep.secret,
                          headers={"Content-Type": content_type})


def test_a_body_of_too_many_values_is_refused_before_it_is_parsed(server: Server,
                                                                   make_endpoint) -> None:
    ep = make_endpoint(ECHO_SIZE, plan="pro")
    most = "[" + ",".join(["1"] * (event.MAX_BODY_VALUES - 1)) + "]"      # the list and 49,999
    assert _post(server, ep, most, "application/json").json == {"n": 49_999, "q": 0}
    over = "[" + ",".join(["[]"] * 349_000) + "]"
    refused = _post(server, ep, over, "application/json")
    assert refused.status == 400 and refused.code == "invalid_body"
    assert "more than 50,000 JSON values" in refused.json["error"]["message"]
    # Sent as text, the same body is the script's text; the hint that it is
    # JSON (which parses it) is not worked out past the cap either (second
    # review, session 28: 92 ms of the loop, after the script ran).
    as_text = _post(server, ep, over, "text/plain")
    assert as_text.status == 200 and "x-logic-hint" not in as_text.headers
    small = _post(server, ep, "[1, 2]", "text/plain")
    assert small.status == 200 and "valid JSON" in small.headers["x-logic-hint"]
    # Commas in a string are no values: a 1 MiB text of them is one value.
    text = json.dumps(["," * 1_000_000])
    assert _post(server, ep, text, "application/json").json == {"n": 1, "q": 0}


def test_a_form_or_query_of_too_many_fields_is_refused(server: Server, make_endpoint) -> None:
    ep = make_endpoint(ECHO_SIZE, plan="pro")
    form = "&".join(f"f{i}=1" for i in range(event.MAX_FORM_FIELDS))
    assert _post(server, ep, form, "application/x-www-form-urlencoded").json == {
        "n": event.MAX_FORM_FIELDS, "q": 0}
    for body, query in (("%41=&" * 209_600, ""), ("", "?" + "a&" * (event.MAX_FORM_FIELDS + 1))):
        refused = _post(server, ep, body, "application/x-www-form-urlencoded", query)
        assert refused.status == 400 and refused.code == "invalid_body"
        assert "more than 1,000 form fields or query parameters" in \
            refused.json["error"]["message"]
