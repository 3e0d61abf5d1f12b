"""Malformed input is a 400 (or the documented 404) with the error envelope, never a
500: numbers that are digits to `str.isdigit()` but not ASCII, times outside what
the database holds, text JSON can carry but UTF-8 cannot."""
from __future__ import annotations

import base64
from urllib.parse import quote

import pytest

from tests.service.api.conftest import Api, assert_error
from tests.service.http.harness import Server

#: "i²" and "i١" (Arabic-Indic one): `isdigit()` is true for both.
SUPERSCRIPT_CURSOR = "acKy"
ARABIC_CURSOR = base64.urlsafe_b64encode("i\u0661".encode()).decode().rstrip("=")
OUT_OF_RANGE = ["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-01:00"]


def _arabic_indic(number: int) -> str:
    return "".join(chr(0x660 + int(d)) for d in str(number))


def _new_log(server: Server, start: int) -> str:
    return "".join(server.log_lines[start:])


@pytest.mark.parametrize("cursor", [SUPERSCRIPT_CURSOR, ARABIC_CURSOR])
def test_a_cursor_of_non_ascii_digits_is_invalid_cursor(world, server, cursor) -> None:
    w = world()
    start = len(server.log_lines)
    for path in (w.script_path + "/history", w.script_path + "/errors",
                 f"/guilds/{w.guild_id}/audit", f"/guilds/{w.guild_id}/scripts"):
        assert_error(w.owner("GET", f"{path}?cursor={cursor}"), 400, "invalid_cursor")
    assert "Traceback" not in _new_log(server, start)


@pytest.mark.parametrize("since", OUT_OF_RANGE)
def test_a_since_out_of_range_is_invalid_since(world, server, since) -> None:
    w = world()
    start = len(server.log_lines)
    err = assert_error(w.owner("GET", f"{w.script_path}/history?since={quote(since)}"),
                       400, "invalid_since")
    assert "out of range" in err["message"]
    assert "Traceback" not in _new_log(server, start)


@pytest.mark.parametrize("when", OUT_OF_RANGE)
def test_an_expiry_out_of_range_is_invalid_input(server, make_token, when) -> None:
    op = Api(server, make_token(None)["token"])
    start = len(server.log_lines)
    err = assert_error(op("POST", "/tokens", {"userId": "1", "expiresAt": when}), 400,
                       "invalid_input")
    assert "expiresAt" in err["message"]
    assert "Traceback" not in _new_log(server, start)


def test_a_token_id_must_be_ascii_digits(server, make_token) -> None:
    op = Api(server, make_token(None)["token"])
    victim = make_token("77")
    user = Api(server, victim["token"])
    start = len(server.log_lines)
    assert_error(op("DELETE", "/tokens/%C2%B2"), 404, "token_not_found")        # "²"
    # The victim's id in Arabic-Indic digits names no token: it stays valid.
    arabic = quote(_arabic_indic(victim["id"]))
    assert_error(op("DELETE", f"/tokens/{arabic}"), 404, "token_not_found")
    assert user("GET", "/me").status == 200
    assert "Traceback" not in _new_log(server, start)
    assert op("DELETE", f"/tokens/{victim['id']}").json == {"id": victim["id"], "revoked": True}
    assert user("GET", "/me").status == 401


def test_a_test_call_with_a_lone_surrogate_is_refused(world, server) -> None:
    w = world()
    start = len(server.log_lines)
    test = w.script_path + "/test"
    assert_error(w.owner("POST", test, {"query": {"b": "\ud800"}}), 400, "invalid_query")
    assert_error(w.owner("POST", test, {"query": {"\udfff": ["x"]}}), 400, "invalid_query")
    assert_error(w.owner("POST", test, {"headers": {"X-A": "\ud800"}}), 400, "invalid_headers")
    assert "Traceback" not in _new_log(server, start)
    # Text UTF-8 can carry still runs.
    ran = w.owner("POST", test, {"query": {"b": "é²"}, "headers": {"X-A": "ü"}})
    assert ran.status == 200 and ran.json["status"] == 200, ran.body


def test_a_test_calls_body_of_too_many_values_is_refused_before_it_is_decoded(world) -> None:
    # Second review, session 28: the admin API decoded a test call's body (up
    # to 1 MiB) on the event loop before anything counted it, past the
    # endpoint's quota too (70-100 ms a call of empty lists).
    w = world()
    test = w.script_path + "/test"
    refused = w.owner("POST", test, {"body": [[] for _ in range(60_000)]})
    err = assert_error(refused, 400, "invalid_body")
    assert "more than 50,000 JSON values" in err["message"]
    ran = w.owner("POST", test, {"body": list(range(40_000))})
    assert ran.status == 200 and ran.json["status"] == 200, ran.body[:300]
    # Refused before the endpoint's quota is looked at: only the call that ran counts.
    assert ran.headers["x-endpoint-ratelimit-remaining"] == "119", ran.headers


def test_a_value_of_another_json_type_is_invalid_input_not_a_guess(world, server,
                                                                    make_token) -> None:
    """`"enabled": "off"` used to switch an endpoint off and `"operator": "on"` to
    make an operator token: request bodies take JSON's own types only."""
    w = world()
    op = Api(server, make_token(None)["token"])
    for body in ({"enabled": "off"}, {"enabled": "yes"}, {"enabled": 1}):
        err = assert_error(w.owner("PATCH", w.script_path + "/endpoint", body), 400,
                           "invalid_input")
        assert "enabled" in err["message"]
    for body in ({"userId": "1", "operator": "on"}, {"userId": 1}):
        assert_error(op("POST", "/tokens", body), 400, "invalid_input")
    # JSON's own types, and an ISO 8601 time in a string, are taken as before.
    assert w.owner("PATCH", w.script_path + "/endpoint", {"enabled": True}).status == 200
    made = op("POST", "/tokens", {"userId": "1", "expiresAt": "2099-01-01T00:00:00Z"})
    assert made.status == 201 and made.json["kind"] == "user"
