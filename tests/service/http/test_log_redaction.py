"""The service log never carries a secret-shaped word (`logic serve`'s formatter)."""
from __future__ import annotations

import io
import logging
import secrets

import os

import pytest

from service.cli.serve import _configure_logging
from service.http.redaction import REDACTED
from tests.service.http.conftest import http_env, make_server  # noqa: F401
from tests.service.http.harness import wait_until


@pytest.fixture
def service_log():
    """The root logger as `logic serve` sets it up, writing to a buffer."""
    root = logging.getLogger()
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    saved = root.handlers[:], root.level
    root.handlers[:] = [handler]
    try:
        _configure_logging()
        yield buffer
    finally:
        root.handlers[:], root.level = saved


def test_secret_shaped_words_never_reach_the_log_tracebacks_included(service_log) -> None:
    # Outside review, session 17: no test failed with the formatter gone, and a
    # secret glued to a word character ("x_lsk_...", "9lsk_...") was logged whole.
    endpoint = "lsk_" + secrets.token_urlsafe(32)
    token = "lat_" + secrets.token_urlsafe(32)
    bearer, basic = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    glued = ["x_" + "lsk_" + secrets.token_urlsafe(32), "9" + "lat_" + secrets.token_urlsafe(32)]
    log = logging.getLogger("logic.test")
    log.warning("secret %s token %s", endpoint, token)
    log.warning("Authorization: Bearer %s / authorization: basic %s", bearer, basic)
    log.warning("glued %s and %s", *glued)
    try:
        raise ValueError(f"a failure quoting {endpoint}")
    except ValueError:
        log.exception("with a traceback")
    text = service_log.getvalue()
    for value in (endpoint, token, bearer, basic, *glued, endpoint[4:], token[4:]):
        assert value not in text, text
    assert text.count(REDACTED) >= 7 and "with a traceback" in text and "ValueError" in text


def test_no_access_line_holds_what_follows_a_login_segment(make_server, tmp_path) -> None:
    # Outside review, session 17: the invoke front's own access line logged
    # `/endpoints/1/login/<token>` whole, and the application's missed
    # `/%6Cogin/<token>` (matched on the encoded path). Access lines are at
    # DEBUG: this server logs them (a sitecustomize turns the level up).
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import logging\nlogging.getLogger('logic.access').setLevel(logging.DEBUG)\n")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    srv = make_server(env={"PYTHONPATH": path})
    token = secrets.token_urlsafe(32)
    paths = (f"/endpoints/1/login/{token}", f"/endpoints/login/{token}",
             f"/endpoints/1/%6Cogin/{token}", f"/%6Cogin/{token}", f"/x/LOGIN/{token}",
             # any letter case once decoded too: `%4C` is `L`, `%6c` is `l`
             f"/%4COGIN/{token}", f"/x/%6cOGIN/{token}",
             # decoded to be cut, a newline must not forge a log line
             f"/x%0Aforged-line/login/{token}", f"/login/%0A{token}",
             # session 24: nor C1 controls (CSI, NEL), nor a bidi override
             f"/x%C2%9B2J%C2%85%E2%80%AEevil/login/{token}")
    # Session 28's review: encoded twice (a link rewriter), or more, and `\`,
    # which browsers read as `/`.
    more = (f"/login%252F{token}", f"/x/%6C%6F%67%69%6E%255C{token}", f"/login%5C{token}",
            f"/login%25252525252F{token}")
    for target in paths + more:
        assert srv.request(target, method="POST", body=b"{}").status in (404, 405)
    wait_until(lambda: srv.log.lower().count("login/…") >= len(paths) + 1
               and srv.log.count("login\\…") >= 2 and "login%…" in srv.log)
    assert token not in srv.log and token[:12] not in srv.log
    assert "\nforged-line" not in srv.log and "%0Aforged-line/login/…" in srv.log
    assert not any(ch in srv.log for ch in "\x9b\x85\u202e")
    assert "%C2%9B2J%C2%85%E2%80%AEevil/login/…" in srv.log


def test_script_replies_and_timeouts_write_no_line_per_request(make_server, make_endpoint
                                                                ) -> None:
    """Outside review, session 24: a script's own 5xx reply got the WARNING
    access line of the service's own failures, and each script that ran past
    its time limit an INFO line: a guild could write lines at its plan's
    rate. Its history and error log say what happened; the log does not."""
    srv = make_server()
    down = make_endpoint("on endpoint(event):\n    event.status(503)\n    event.reply('no')\n",
                         plan="bench")
    spin = make_endpoint("on endpoint(event):\n    while True:\n        pass\n", plan="bench")
    before = len(srv.log_lines)
    for _ in range(5):
        assert srv.request(down.path, json_body={}, secret=down.secret).status == 503
    for _ in range(2):
        assert srv.request(spin.path, json_body={}, secret=spin.secret).code == "script_timeout"
    assert srv.request("/healthz", method="GET").status == 200
    lines = srv.log_lines[before:]
    assert not [line for line in lines if "WARNING" in line or "INFO" in line], lines


def test_an_uncaught_exception_is_logged_without_a_login_token(service_log) -> None:
    # The access line cut a login link's token; the line of an uncaught
    # exception printed the path whole (review, session 29).
    from unittest.mock import MagicMock

    from tornado.httputil import HTTPHeaders, HTTPServerRequest, RequestStartLine
    from tornado.web import Application

    from service.http.base import BaseHandler

    token = secrets.token_urlsafe(32)
    request = HTTPServerRequest(start_line=RequestStartLine("GET", f"/login%2F{token}/x",
                                                            "HTTP/1.1"),
                                headers=HTTPHeaders({"Host": "127.0.0.1"}),
                                connection=MagicMock())
    handler = BaseHandler(Application(), request, context=MagicMock())
    try:
        raise RuntimeError("boom")
    except RuntimeError as err:
        handler.log_exception(RuntimeError, err, err.__traceback__)
    text = service_log.getvalue()
    assert "uncaught exception on /login/…" in text and "boom" in text
    assert token not in text
