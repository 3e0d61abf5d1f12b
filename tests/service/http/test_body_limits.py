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

import pytest

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


def test_the_ledger_gives_back_up_to_its_burst_and_leaks() -> None:
    from service.http.parse_ledger import BURST_S, MAX_GUILDS, RATE_S, ParseLedger
    now = [100.0]
    ledger = ParseLedger(clock=lambda: now[0])
    assert ledger.refund("g", BURST_S)               # up to the burst: given back
    assert not ledger.refund("g", 0.01)              # past it: the slot stays used
    assert ledger.refund("other", 0.01)
    now[0] += 0.02 / RATE_S                          # leaked: room for 0.02 s again
    assert ledger.refund("g", 0.01) and not ledger.refund("g", 0.02)
    for n in range(MAX_GUILDS + 10):
        ledger.refund(f"x{n}", 0.1)
    assert len(ledger._spent) == MAX_GUILDS


@pytest.mark.parametrize("values, each", [(49_000, 40), (8_190, 160)])
def test_a_guild_whose_bodies_keep_being_refused_busy_stops_getting_refunds(
        make_server, make_endpoint, values: int, each: int) -> None:
    # Second review, session 28: a request refused busy gives its quota slot
    # back, but its body was decoded first: requests timing out in a full
    # queue had bodies decoded past the rate limit, again and again. Past
    # parse_ledger.BURST_S of decoding given back, the guild's 503s keep
    # their slots (third review: whatever the body's size; bodies of 16,383
    # bytes, under a first version's threshold, were never charged).
    import threading
    server = make_server(workers=1, queue_timeout_ms=20)
    ep = make_endpoint("import time\non endpoint(event):\n"
                       "    if event.body[0] == 1:\n"
                       "        t = time.monotonic()\n"
                       "        while time.monotonic() - t < 0.3:\n"
                       "            pass\n"
                       "    event.reply(1)\n", plan="bench")
    # 909 KiB (~12 ms to decode here), or 16,383 bytes (~1 ms).
    body = "[" + ",".join(["1"] + ["123456789012345678" if values > 10_000 else "0"] * values) + "]"
    statuses: list[int] = []

    def send(n: int) -> None:
        for _ in range(n):
            statuses.append(_post(server, ep, body, "application/json").status)

    senders = [threading.Thread(target=send, args=(each,)) for _ in range(8)]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join(120)
    busy, ran = statuses.count(503), statuses.count(200)
    assert busy + ran == 8 * each and busy >= 4 * each, (busy, ran)
    import time
    time.sleep(0.5)                                   # the last spin ends
    last = _post(server, ep, "[0]", "application/json")
    assert last.status == 200
    counted = int(last.headers["ratelimit-limit"]) - int(last.headers["ratelimit-remaining"])
    # With every 503 given back only the 200s and this one would count (0.5 s
    # of decoding given back is passed after ~40 large bodies or ~500 small).
    assert counted > ran + 1 + 20, (counted, ran, busy)


def test_a_guild_holds_at_most_16_large_bodies_decoded_and_others_are_not_affected(
        make_server, make_endpoint) -> None:
    # Review, session 28: a queued request keeps its decoded body (up to ~4 MB
    # of objects and its raw MiB) and the queue holds 256 requests a worker:
    # one guild could keep gigabytes. Past 16 of its large bodies decoded and
    # not yet answered, the next is 503 busy before it is decoded.
    import threading
    from service.http.parse_ledger import MAX_HELD_PER_GUILD
    server = make_server(workers=1, queue_timeout_ms=20000)
    spin = ("import time\non endpoint(event):\n    t = time.monotonic()\n"
            "    while time.monotonic() - t < 0.15:\n        pass\n    event.reply(1)\n")
    ep = make_endpoint(spin, plan="bench")
    other = make_endpoint(spin, plan="bench")
    body = json.dumps("x" * 20_000)                  # one value, 20 KB
    statuses: list[int] = []

    def send() -> None:
        statuses.append(_post(server, ep, body, "application/json").status)

    flood = [threading.Thread(target=send) for _ in range(MAX_HELD_PER_GUILD + 6)]
    for thread in flood:
        thread.start()
    import time
    time.sleep(0.5)                                  # all have arrived; 16 are held
    assert _post(server, other, body, "application/json").status == 200
    for thread in flood:
        thread.join(60)
    assert sorted(statuses) == [200] * MAX_HELD_PER_GUILD + [503] * 6, statuses
    assert _post(server, ep, body, "application/json").status == 200   # released
