"""History pages, filters and records, test calls and replays, errors and stats."""
from __future__ import annotations

import json
from typing import Any

from tests.service.api.conftest import assert_error
from tests.service.http.harness import wait_until

FAILING = ('on endpoint(event):\n    if event.body and event.body.get("fail"):\n'
           '        raise ValueError("boom")\n    event.status(event.body.get("status", 200) '
           'if event.body else 200)\n    event.reply({"ok": True})\n')


def _history(api: Any, path: str, query: str = "") -> list[dict[str, Any]]:
    resp = api("GET", path + "/history" + query)
    assert resp.status == 200, resp.body
    return resp.json["items"]  # type: ignore[no-any-return]


def _invoke(server: Any, w: Any, secret: str, body: dict[str, Any]) -> Any:
    return server.request(f"/endpoints/{w.guild_id}/{w.script_id}", json_body=body, secret=secret)


def test_pages_stay_stable_while_requests_arrive(world, server) -> None:
    w = world()
    path = w.script_path
    w.owner("PATCH", path + "/endpoint", {"enabled": True})
    secret = w.owner("POST", path + "/endpoint/secret").json["secret"]
    for i in range(7):
        assert _invoke(server, w, secret, {"n": i}).status == 200
    assert wait_until(lambda: len(_history(w.manager, path)) == 7)
    first = w.manager("GET", path + "/history?limit=3").json
    assert [r["body"] for r in first["items"]] == ['{"n": 6}', '{"n": 5}', '{"n": 4}']
    # New requests arrive between pages: they must not shift the pages after.
    for i in range(7, 10):
        assert _invoke(server, w, secret, {"n": i}).status == 200
    assert wait_until(lambda: len(_history(w.manager, path)) == 10)
    second = w.manager("GET", f"{path}/history?limit=3&cursor={first['nextCursor']}").json
    assert [r["body"] for r in second["items"]] == ['{"n": 3}', '{"n": 2}', '{"n": 1}']
    third = w.manager("GET", f"{path}/history?limit=3&cursor={second['nextCursor']}").json
    assert [r["body"] for r in third["items"]] == ['{"n": 0}'] and third["nextCursor"] is None
    assert all(r["test"] is False for r in first["items"] + second["items"])


def test_filters_one_record_and_errors(world, server) -> None:
    w = world()
    path = w.script_path
    w.owner("PUT", path, {"source": FAILING})
    w.owner("PATCH", path + "/endpoint", {"enabled": True})
    secret = w.owner("POST", path + "/endpoint/secret").json["secret"]
    assert _invoke(server, w, secret, {"status": 201}).status == 201
    assert _invoke(server, w, secret, {"status": 404}).status == 404
    assert _invoke(server, w, secret, {"fail": True}).status == 500
    assert wait_until(lambda: len(_history(w.manager, path)) == 3)
    assert [r["status"] for r in _history(w.manager, path, "?status=4xx")] == [404]
    assert [r["status"] for r in _history(w.manager, path, "?status=201")] == [201]
    assert [r["status"] for r in _history(w.manager, path, "?status=5xx")] == [500]
    assert _history(w.manager, path, "?since=2999-01-01T00:00:00Z") == []
    assert len(_history(w.manager, path, "?since=2000-01-01T00:00:00Z")) == 3
    assert_error(w.manager("GET", path + "/history?since=yesterday"), 400, "invalid_since")
    bad_status = assert_error(w.manager("GET", path + "/history?status=2x"), 400, "invalid_input")
    assert bad_status["message"].startswith("status: expected 2xx, 4xx or 5xx")
    assert "pattern" not in bad_status["message"]
    newest = _history(w.manager, path)[0]
    one = w.manager("GET", f"{path}/history/{newest['requestId']}")
    assert one.status == 200 and one.json == newest
    assert "authorization" not in one.json["headers"] and secret not in str(one.json)
    assert_error(w.manager("GET", f"{path}/history/req_nope"), 404, "request_not_found")
    assert_error(w.stranger("GET", f"{path}/history/{newest['requestId']}"), 404,
                 "guild_not_found")
    assert wait_until(lambda: w.manager("GET", path + "/errors").json["items"] != [])
    error = w.manager("GET", path + "/errors").json["items"][0]
    assert error["kind"] == "script_error" and error["requestId"] == newest["requestId"]
    assert "boom" in error["message"]


def test_test_call_runs_the_pipeline_and_is_marked(world) -> None:
    w = world()
    path = w.script_path
    # A disabled endpoint without a secret can be tried: that is what the console is for.
    resp = w.manager("POST", path + "/test", {"body": {"hi": 1}, "query": {"a": "b"},
                                             "headers": {"X-Thing": "1",
                                                         "Authorization": "Bearer lsk_x"}})
    assert resp.status == 200, resp.body
    result = resp.json
    assert result["test"] is True and result["status"] == 200 and result["error"] is None
    assert result["body"] == '{"echo":{"hi":1}}' and result["output"] == "got {'hi': 1}\n"
    assert result["requestId"] == resp.headers["x-request-id"]
    assert resp.headers["x-endpoint-ratelimit-limit"] == "120"
    assert wait_until(lambda: len(_history(w.manager, path)) == 1)
    record = _history(w.manager, path)[0]
    assert record["test"] is True and record["requestId"] == result["requestId"]
    assert record["scriptVersion"] == 1    # the version that ran, as for an invocation
    assert record["query"] == {"a": "b"} and record["headers"]["x-thing"] == "1"
    assert "authorization" not in record["headers"]
    # Replayed: the same request again, a new record marked as a test call.
    replay = w.owner("POST", f"{path}/history/{record['requestId']}/replay")
    assert replay.status == 200 and replay.json["replayOf"] == record["requestId"]
    assert replay.json["body"] == result["body"]
    assert wait_until(lambda: len(_history(w.manager, path)) == 2)
    assert wait_until(lambda: w.manager("GET", path + "/stats").json["testCalls"] == 2)
    stats = w.manager("GET", path + "/stats").json
    assert stats["total"] == 2 and stats["byStatus"] == {"200": 2}
    assert_error(w.stranger("POST", path + "/test", {}), 404, "guild_not_found")
    assert_error(w.manager("POST", path + "/test", {"method": "GET"}), 400, "invalid_method")
    assert_error(w.manager("POST", f"{path}/history/req_nope/replay"), 404, "request_not_found")


def test_test_call_script_failure_is_the_invoke_answer(world) -> None:
    w = world()
    w.owner("PUT", w.script_path, {"source": FAILING})
    result = w.manager("POST", w.script_path + "/test", {"body": {"fail": True}}).json
    assert result["status"] == 500 and result["error"] == "script_error"
    assert '"script_error"' in result["body"] and result["requestId"] in result["body"]
    assert wait_until(lambda: w.manager("GET", w.script_path + "/errors").json["items"] != [])
    assert w.manager("GET", w.script_path + "/errors").json["items"][0]["scriptVersion"] == 2


def test_a_test_calls_request_can_be_read_and_replayed_at_once(world) -> None:
    """The documented test-then-replay: the record is written before the test
    call answers (it was not: 20 of 20 replays right after got 404)."""
    w = world()
    path = w.script_path
    for _ in range(5):
        result = w.manager("POST", path + "/test", {"body": {"score": 21}}).json
        one = w.manager("GET", f"{path}/history/{result['requestId']}")
        assert one.status == 200, one.body
        again = w.owner("POST", f"{path}/history/{result['requestId']}/replay")
        assert again.status == 200 and again.json["replayOf"] == result["requestId"]
        assert w.manager("GET", f"{path}/history/{again.json['requestId']}").status == 200


def test_a_test_call_answers_what_the_invoke_path_sends(world, server) -> None:
    w = world()
    path = w.script_path
    w.owner("PUT", path, {"source": 'on endpoint(event):\n    event.status(205)\n'
                                    '    event.header("Vary", "a")\n    event.header("Vary", "b")\n'
                                    '    event.reply({"a": 1})\n'})
    w.owner("PATCH", path + "/endpoint", {"enabled": True})
    secret = w.owner("POST", path + "/endpoint/secret").json["secret"]
    live = _invoke(server, w, secret, {})
    assert live.status == 205 and live.body == b""
    assert [v for k, v in live.raw_headers if k.lower() == "vary"] == ["a", "b"]
    result = w.manager("POST", path + "/test", {"body": {}}).json
    assert result["status"] == 205 and result["body"] == ""
    assert result["headers"]["Vary"] == "a, b" and "Content-Type" not in result["headers"]


def test_test_calls_count_once_against_the_quota(world, server) -> None:
    """plus allows 30 requests a minute: test calls and live calls share them, each once."""
    w = world("plus")
    path = w.script_path
    w.owner("PATCH", path + "/endpoint", {"enabled": True})
    secret = w.owner("POST", path + "/endpoint/secret").json["secret"]
    for _ in range(15):
        assert w.manager("POST", path + "/test", {"body": {}}).status == 200
    for _ in range(15):
        assert _invoke(server, w, secret, {}).status == 200
    assert_error(w.manager("POST", path + "/test", {"body": {}}), 429, "rate_limited")
    assert _invoke(server, w, secret, {}).status == 429
    assert wait_until(lambda: w.manager("GET", path + "/stats").json["total"] == 32)
    assert w.manager("GET", path + "/stats").json["testCalls"] == 16
    # Accepted calls are history (30, the 2 refused are statistics only).
    assert wait_until(lambda: len(_history(w.manager, path, "?limit=200")) == 20)  # plus keeps 20


def test_test_body_over_the_plan_is_413(world) -> None:
    w = world("plus")
    big = "x" * (131072 + 1)
    assert_error(w.manager("POST", w.script_path + "/test", {"body": big}), 413,
                 "payload_too_large")


LOOP = "on endpoint(event):\n    while True:\n        pass\n"


def test_a_secret_pasted_into_a_test_call_is_redacted(world) -> None:
    """A test call presents no secret, so the endpoint's own secret pasted into
    its body or a parameter's name (and printed and echoed by the script) is
    found by its shape."""
    w = world()
    secret = w.owner("POST", w.script_path + "/endpoint/secret").json["secret"]
    resp = w.manager("POST", w.script_path + "/test",
                     {"body": {"s": secret, "tail": secret[4:]},
                      "query": {"k": secret, secret: "as a name"}})
    assert resp.status == 200, resp.body
    assert wait_until(lambda: len(_history(w.manager, w.script_path)) == 1)
    record = json.dumps(_history(w.manager, w.script_path)[0])
    kept = secret[4:] in record   # not asserted in place: a failure would print it
    assert not kept and "[redacted]" in record
    # Only a name holds it: found there too.
    resp = w.manager("POST", w.script_path + "/test", {"body": {}, "query": {secret: "v"}})
    assert resp.status == 200, resp.body
    assert wait_until(lambda: len(_history(w.manager, w.script_path)) == 2)
    records = json.dumps(_history(w.manager, w.script_path))
    kept = secret[4:] in records
    assert not kept
    # Without its prefix, or with it in capitals: the random part standing alone
    # is checked against the endpoint's verifier; another such run is kept.
    other = "B" * 43
    for body in ({"s": secret[4:], "o": other}, {"s": "LSK_" + secret[4:]}):
        resp = w.owner("POST", w.script_path + "/test", {"body": body})
        assert resp.status == 200, resp.body
    assert wait_until(lambda: len(_history(w.manager, w.script_path)) == 4)
    records = json.dumps(_history(w.manager, w.script_path))
    kept = secret[4:] in records
    assert not kept and other in records


def test_credential_named_values_of_a_test_call_are_redacted(world) -> None:
    """A test call's headers and query parameters named as credentials are kept
    as [redacted] like an invocation's (docs/http-api.md), not only when it
    also carries a secret's shape (they were kept as sent)."""
    w = world()
    resp = w.manager("POST", w.script_path + "/test",
                     {"body": {}, "query": {"apitoken": "CRED1", "page": "2"},
                      "headers": {"X-AuthToken": "CRED2", "X-Api-Key": "CRED3",
                                  "X-Thing": "1"}})
    assert resp.status == 200, resp.body
    assert wait_until(lambda: len(_history(w.manager, w.script_path)) == 1)
    record = _history(w.manager, w.script_path)[0]
    assert record["query"] == {"apitoken": "[redacted]", "page": "2"}
    assert record["headers"]["x-authtoken"] == "[redacted]"
    assert record["headers"]["x-api-key"] == "[redacted]"
    assert record["headers"]["x-thing"] == "1"
    assert "CRED" not in json.dumps(record)


def test_test_calls_run_on_their_own_guilds_workers(world) -> None:
    """A test call is the guild's own request to the sandbox: with two run slots and
    half of them per guild, guild A's two looping test calls hold one slot and wait
    in A's own queue, and guild B's test call runs at once on the other slot (were
    test calls of every guild one tenant, B would wait behind A's calls, and its
    script would run on workers that ran A's)."""
    import threading
    import time
    a, b = world(), world()
    assert a.owner("PUT", a.script_path, {"source": LOOP}).status == 200
    done: dict[str, float] = {}
    statuses: dict[str, int] = {}

    def call(name: str, w, pause: float) -> None:
        time.sleep(pause)
        resp = w.manager("POST", w.script_path + "/test", {"body": {"n": 1}})
        done[name], statuses[name] = time.monotonic(), resp.json["status"]

    threads = [threading.Thread(target=call, args=("a1", a, 0.0)),
               threading.Thread(target=call, args=("a2", a, 0.05)),
               threading.Thread(target=call, args=("b", b, 0.3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert statuses == {"a1": 504, "a2": 504, "b": 200}, statuses
    assert done["b"] < min(done["a1"], done["a2"]), done
