"""`GET /metrics` of a real `logic serve`: the counters move with requests, access is restricted.

Every scrape is parsed with `prometheus_client.parser`; counters are compared
as differences between two scrapes of the same server.
"""

from __future__ import annotations

import re
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.service.http.conftest import CONFIG, Env
from tests.service.http.harness import Response, Server, wait_until
from tests.service.http.test_checks import ECHO, assert_error

TOKEN = "metrics-token-0123456789abcdef"
#: Server A: defaults (loopback may scrape, no token, no guild label); plus limited to 3/min.
PLUS_LIMIT = 3
DEFAULT_EXTRA = f"[plans.plus]\nrequests_per_minute = {PLUS_LIMIT}\n"
#: Server B: per-guild labels, one address and a token.
RESTRICTED_EXTRA = f"""[metrics]
per_guild = true
allow = ["127.0.0.1/32"]
token = "{TOKEN}"
"""
RAISE = "on endpoint(event):\n    raise ValueError('boom')\n"
LOOP = "on endpoint(event):\n    while True:\n        pass\n"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _start(http_env: Env, root: Path, extra: str, env: dict[str, str] | None = None,
           workers: int = 2, queue_timeout_ms: int = 2000) -> Server:
    config = root / "logic.toml"
    config.write_text(f"[sandbox]\nworkers = {workers}\nqueue_timeout_ms = {queue_timeout_ms}\n"
                      f"{extra}\n"
                      f'[records]\njournal = "{root / "journal"}"\n{CONFIG}')
    return Server(http_env.database_url, str(config), env=env or {}).start()


@pytest.fixture(scope="module")
def plain(http_env: Env, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = _start(http_env, tmp_path_factory.mktemp("metrics"), DEFAULT_EXTRA)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def restricted(http_env: Env, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = _start(http_env, tmp_path_factory.mktemp("metrics-restricted"), RESTRICTED_EXTRA)
    yield srv
    srv.stop()


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def scrape(server: Server, **headers: str) -> Samples:
    resp = server.request("/metrics", method="GET", headers=headers)
    assert resp.status == 200, resp.body
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(resp.body.decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum over every sample of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def invoke(server: Server, ep: Any, **kwargs: Any) -> Response:
    return server.request(ep.path, json_body={}, secret=kwargs.pop("secret", ep.secret), **kwargs)


def test_invoke_counters_move_with_requests(plain: Server, make_endpoint, source_ip) -> None:
    ok = make_endpoint(source=ECHO)
    failing = make_endpoint(source=RAISE)
    looping = make_endpoint(source=LOOP)
    limited = make_endpoint(source=ECHO, plan="plus")
    before = scrape(plain)

    for _ in range(3):
        assert invoke(plain, ok).status == 200
    assert_error(plain.request_from(source_ip(), ok.path, json_body={}, secret="lsk_wrong"),
                 401, "unauthorized")
    assert_error(plain.request(ok.path.rsplit("/", 1)[0] + "/logic_" + "u" * 22, json_body={}),
                 404, "endpoint_not_found")
    assert_error(invoke(plain, failing), 500, "script_error")
    assert_error(invoke(plain, looping), 504, "script_timeout")
    for _ in range(PLUS_LIMIT):
        assert invoke(plain, limited).status == 200
    assert_error(invoke(plain, limited), 429, "rate_limited")

    after = scrape(plain)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    requests = "logic_invoke_requests_total"
    assert moved(requests, status="200", code="", plan="pro") == 3
    assert moved(requests, status="401", code="unauthorized", plan="pro") == 1
    assert moved(requests, status="404", code="endpoint_not_found", plan="") == 1
    assert moved(requests, status="500", code="script_error", plan="pro") == 1
    assert moved(requests, status="504", code="script_timeout", plan="pro") == 1
    assert moved(requests, status="200", code="", plan="plus") == PLUS_LIMIT
    assert moved(requests, status="429", code="rate_limited", plan="plus") == 1
    assert moved("logic_invoke_rate_limited_total", plan="plus") == 1
    assert moved("logic_invoke_plan_requests_total", plan="pro") == 6
    assert moved("logic_invoke_plan_requests_total", plan="plus") == PLUS_LIMIT + 1

    # Service time: every answered request of the plan; script time: the scripts that ran.
    assert moved("logic_invoke_duration_seconds_count", plan="pro") == 6
    assert moved("logic_script_duration_seconds_count", plan="pro") == 5
    assert moved("logic_invoke_duration_seconds_count", plan="plus") == PLUS_LIMIT + 1
    assert moved("logic_script_duration_seconds_count", plan="plus") == PLUS_LIMIT
    # The timed-out script ran for about its 1 s limit: above the 0.5 s bucket, so the
    # count is above that bucket's by at least one.
    over = (moved("logic_script_duration_seconds_count", plan="pro")
            - moved("logic_script_duration_seconds_bucket", plan="pro", le="0.5"))
    assert over >= 1
    assert moved("logic_script_duration_seconds_sum", plan="pro") >= 0.9

    assert moved("logic_sandbox_timeouts_total") == 1
    assert moved("logic_sandbox_invocations_total") == 5 + PLUS_LIMIT


def test_auth_throttle_is_counted(plain: Server, make_endpoint, source_ip) -> None:
    ep = make_endpoint(source=ECHO)
    ip = source_ip()
    before = scrape(plain)
    for _ in range(20):
        assert plain.request_from(ip, ep.path, json_body={}, secret="lsk_wrong").status == 401
    assert_error(plain.request_from(ip, ep.path, json_body={}, secret="lsk_wrong"), 429,
                 "auth_throttled")
    after = scrape(plain)
    assert (value(after, "logic_invoke_auth_throttled_total")
            - value(before, "logic_invoke_auth_throttled_total")) == 1
    assert (value(after, "logic_invoke_requests_total", status="401", code="unauthorized",
                  plan="pro")
            - value(before, "logic_invoke_requests_total", status="401", code="unauthorized",
                    plan="pro")) == 20


def test_pool_gauges_and_record_counters(plain: Server, make_endpoint) -> None:
    samples = scrape(plain)
    assert value(samples, "logic_sandbox_run_slots") == 2
    for gauge in ("logic_sandbox_workers", "logic_sandbox_workers_busy",
                  "logic_sandbox_workers_idle", "logic_sandbox_queue_depth",
                  "logic_sandbox_guilds", "logic_records_pending"):
        assert (gauge, frozenset()) in samples, gauge
    assert value(samples, "logic_sandbox_workers") >= 2
    assert value(samples, "logic_sandbox_queue_depth") == 0
    for counter in ("crashes", "restarts", "memory_kills", "busy_rejections", "queued",
                    "deprioritised", "quarantined", "retired"):
        assert (f"logic_sandbox_{counter}_total", frozenset()) in samples, counter

    ep = make_endpoint(source=ECHO)
    written = value(samples, "logic_records_written_total")
    for _ in range(4):
        assert invoke(plain, ep).status == 200
    # The record writer runs every 0.25 s: wait for it, never for a fixed time.
    assert wait_until(lambda: value(scrape(plain), "logic_records_written_total") >= written + 4,
                      timeout=20)
    final = scrape(plain)
    assert value(final, "logic_records_dropped_total") == 0
    assert value(final, "logic_records_failed_batches_total") == 0


def test_other_fronts_are_counted(plain: Server) -> None:
    before = scrape(plain)
    assert plain.request("/healthz", method="GET").status == 200
    assert_error(plain.request("/api/v1/guilds/1", method="GET"), 401, "unauthorized")
    assert_error(plain.request("/no/such/page", method="GET"), 404, "not_found")
    after = scrape(plain)

    def moved(**labels: str) -> float:
        return (value(after, "logic_http_requests_total", **labels)
                - value(before, "logic_http_requests_total", **labels))

    assert moved(front="health", status="200", code="") == 1
    assert moved(front="api", status="401", code="unauthorized") == 1
    assert moved(front="other", status="404", code="not_found") == 1
    assert moved(front="metrics", status="200", code="") == 1  # the first scrape


def test_refusals_of_the_connection_layer_are_counted(plain: Server) -> None:
    before = scrape(plain)
    with socket.create_connection(("127.0.0.1", plain.port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\nBad Header\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 400 ")
    after = scrape(plain)
    labels = {"front": "connection", "status": "400", "code": "bad_request"}
    assert (value(after, "logic_http_requests_total", **labels)
            - value(before, "logic_http_requests_total", **labels)) == 1


def test_no_guild_label_and_no_secret_or_header_value(plain: Server, make_endpoint) -> None:
    ep = make_endpoint(source=ECHO)
    marker = "ZmarkerZ4711"
    plain.request(ep.path + f"?q={marker}q", json_body={"b": marker + "b"}, secret=ep.secret,
                  headers={"User-Agent": marker + "ua", "X-Custom": marker + "h",
                           "Cookie": "c=" + marker + "c"})
    plain.request(ep.path, json_body={}, secret=marker + "secret",
                  headers={"X-Service-Secret": marker + "svc"})
    resp = plain.request("/metrics", method="GET")
    text = resp.body.decode()
    assert resp.status == 200
    for needle in (marker, ep.secret, ep.script_id):
        assert needle not in text, needle
    # The guild id is all digits: as a whole token, not inside a sample's value
    # (a duration such as 1.026769341004183 once held "10041" by chance).
    assert not re.search(rf"(?<![\d.]){ep.guild_id}(?![\d.])", text), ep.guild_id
    for (_, labels) in parse(text):
        assert "guild" not in dict(labels)


@pytest.mark.parametrize("header", ["X-Forwarded-For", "X-Real-IP", "Forwarded"])
def test_a_proxied_scrape_is_refused(plain: Server, header: str) -> None:
    resp = plain.request("/metrics", method="GET", headers={header: "127.0.0.1"})
    assert_error(resp, 404, "not_found")
    assert b"logic_" not in resp.body


def test_a_scrape_through_the_shipped_nginx_is_refused(plain: Server, tmp_path: Path) -> None:
    """nginx on the same host reaches the service from loopback: its forwarding header
    is what keeps the internet out."""
    from tests.service.http.test_nginx import NGINX, _free_port, _test_config

    if NGINX is None:
        pytest.skip("the nginx binary is not installed (Debian package nginx; CI installs it)")
    port = _free_port()
    conf = tmp_path / "nginx.conf"
    conf.write_text(_test_config(plain.port, port, tmp_path))
    proc = subprocess.Popen([NGINX, "-p", str(tmp_path), "-c", str(conf), "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proxied = Server(plain.database_url, port=port)

        def answered() -> bool:
            try:
                return proxied.request("/healthz", method="GET").status == 200
            except OSError:
                return False

        assert wait_until(answered, timeout=10), "nginx did not start"
        resp = proxied.request("/metrics", method="GET", headers={"Host": "endpoints.example.com"})
        assert_error(resp, 404, "not_found")
        assert b"logic_" not in resp.body
        assert plain.request("/metrics", method="GET").status == 200  # directly: allowed
    finally:
        proc.terminate()
        proc.wait(10)


def test_only_get(plain: Server) -> None:
    assert_error(plain.request("/metrics", method="POST", body=b"x"), 405, "method_not_allowed")


def test_strangers_and_wrong_tokens_are_refused(restricted: Server) -> None:
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    # Outside `metrics.allow`: the same 404 as an unknown path, token or not.
    for headers in ({}, bearer):
        resp = restricted.request_from("127.0.0.2", "/metrics", method="GET", headers=headers)
        assert_error(resp, 404, "not_found")
        assert b"logic_" not in resp.body
    for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"},
                    {"Authorization": TOKEN}, {"X-Service-Secret": TOKEN}):
        resp = restricted.request("/metrics", method="GET", headers=headers)
        assert_error(resp, 401, "unauthorized")
        assert resp.headers["www-authenticate"] == "Bearer"
        assert b"logic_" not in resp.body
        assert TOKEN not in resp.body.decode()
    samples = scrape(restricted, **bearer)
    assert value(samples, "logic_sandbox_run_slots") == 2
    # The refusals are counted like any request, the token nowhere.
    assert value(samples, "logic_http_requests_total", front="metrics", status="404",
                 code="not_found") == 2
    assert TOKEN not in restricted.log


def test_per_guild_labels_the_request_counter_only(restricted: Server, make_endpoint) -> None:
    ep = make_endpoint(source=ECHO)
    assert invoke(restricted, ep).status == 200
    assert invoke(restricted, ep, secret="lsk_wrong").status == 401
    # A guild id nobody registered never becomes a label value.
    unknown = f"/endpoints/987654321987/{ep.script_id}"
    assert_error(restricted.request(unknown, json_body={}), 404, "endpoint_not_found")
    resp = restricted.request("/metrics", method="GET",
                              headers={"Authorization": f"Bearer {TOKEN}"})
    assert "987654321987" not in resp.body.decode()
    samples = parse(resp.body.decode())
    assert value(samples, "logic_invoke_requests_total", status="404", code="endpoint_not_found",
                 plan="", guild="") >= 1
    requests = "logic_invoke_requests_total"
    assert value(samples, requests, status="200", code="", plan="pro", guild=ep.guild_id) == 1
    assert value(samples, requests, status="401", code="unauthorized", plan="pro",
                 guild=ep.guild_id) == 1
    for (name, labels) in samples:
        if "guild" in dict(labels):
            assert name == requests, name
    assert total(samples, "logic_invoke_duration_seconds_count", plan="pro") >= 2


def test_busy_answers_and_pool_gauges_under_load(http_env: Env, tmp_path: Path,
                                                 make_endpoint) -> None:
    # One run slot, a 100 ms queue wait and a 5 s time limit: while one script
    # loops, another request of the same guild waits, then is answered 503 busy.
    # The second is sent only once the first is seen running, and the first
    # runs for 5 s: the second waits out its 100 ms however slow the machine is.
    srv = _start(http_env, tmp_path, "[plans.pro]\ntime_limit_ms = 5000\n", workers=1,
                 queue_timeout_ms=100)
    try:
        ep = make_endpoint(source=LOOP)
        before = scrape(srv)
        results: list[Response] = []
        first = threading.Thread(target=lambda: results.append(invoke(srv, ep)))
        first.start()
        assert wait_until(lambda: value(scrape(srv), "logic_sandbox_workers_busy") == 1,
                          timeout=10)
        assert_error(invoke(srv, ep), 503, "busy")
        first.join(30)
        assert_error(results[0], 504, "script_timeout")
        after = scrape(srv)
        assert value(after, "logic_sandbox_workers_busy") == 0
        assert value(after, "logic_sandbox_queue_depth") == 0
        for name, labels in (("logic_invoke_busy_total", {"plan": "pro"}),
                             ("logic_invoke_requests_total",
                              {"status": "503", "code": "busy", "plan": "pro"}),
                             ("logic_sandbox_queued_total", {}),
                             ("logic_sandbox_timeouts_total", {})):
            assert value(after, name, **labels) - value(before, name, **labels) == 1, name
    finally:
        srv.stop()


def test_allow_empty_turns_metrics_off(http_env: Env, tmp_path: Path) -> None:
    srv = _start(http_env, tmp_path, "[metrics]\nallow = []\n")
    try:
        assert_error(srv.request("/metrics", method="GET"), 404, "not_found")
    finally:
        srv.stop()

