"""Rate limits, failed-secret throttling and secret rotation, end to end."""

from __future__ import annotations

import subprocess
import sys
import time

from service.http.ratelimit import AUTH_FAILURES_PER_MINUTE
from tests.service.http.harness import Server
from tests.service.http.test_checks import ECHO, assert_error


def test_quota_is_exact_and_retry_after_is_right(server: Server, make_endpoint) -> None:
    ep = make_endpoint(source=ECHO, plan="plus")  # 30 per minute
    first = time.time()
    remaining = []
    for _ in range(30):
        resp = server.request(ep.path, json_body={}, secret=ep.secret)
        assert resp.status == 200, resp.body
        assert resp.headers["ratelimit-limit"] == "30"
        remaining.append(int(resp.headers["ratelimit-remaining"]))
    assert remaining == list(range(29, -1, -1))
    resp = server.request(ep.path, json_body={}, secret=ep.secret)
    assert_error(resp, 429, "rate_limited")
    expected = 60 - (time.time() - first)
    assert abs(int(resp.headers["retry-after"]) - expected) <= 1.5
    assert resp.headers["ratelimit-remaining"] == "0"
    assert abs(int(resp.headers["ratelimit-reset"]) - expected) <= 1.5


def test_unauthenticated_requests_do_not_use_the_quota(server: Server, make_endpoint,
                                                       source_ip) -> None:
    ep = make_endpoint(source=ECHO, plan="plus")
    ip = source_ip()
    for _ in range(15):
        assert server.request_from(ip, ep.path, json_body={}, secret="lsk_wrong").status == 401
        assert server.request_from(ip, ep.path, json_body={}).status == 401
    resp = server.request(ep.path, json_body={}, secret=ep.secret)
    assert resp.status == 200
    assert resp.headers["ratelimit-remaining"] == "29"


def test_more_than_20_wrong_secrets_are_throttled(server: Server, make_endpoint,
                                                  source_ip) -> None:
    ip = source_ip()
    ep = make_endpoint(source=ECHO)
    for _ in range(20):
        resp = server.request_from(ip, ep.path, json_body={}, secret="lsk_wrong")
        assert_error(resp, 401, "unauthorized")
    resp = server.request_from(ip, ep.path, json_body={}, secret="lsk_wrong")
    assert_error(resp, 429, "auth_throttled")
    assert 55 <= int(resp.headers["retry-after"]) <= 60
    # Throttled without checking: even the right secret waits.
    assert_error(server.request_from(ip, ep.path, json_body={}, secret=ep.secret), 429,
                 "auth_throttled")
    # Another address is not affected.
    assert server.request_from(source_ip(), ep.path, json_body={}, secret=ep.secret).status == 200


def test_a_throttled_address_still_gets_the_earlier_checks_first(server: Server, make_endpoint,
                                                                 source_ip) -> None:
    ip = source_ip()
    ep = make_endpoint(source=ECHO)
    for _ in range(21):
        server.request_from(ip, ep.path, json_body={}, secret="lsk_wrong")
    assert_error(server.request_from(ip, ep.path, json_body={}, secret="lsk_wrong"), 429,
                 "auth_throttled")
    unknown = ep.path.rsplit("/", 1)[0] + "/logic_" + "u" * 22
    disabled = make_endpoint(source=ECHO, enabled=False)
    allowlisted = make_endpoint(source=ECHO, whitelist=["192.0.2.0/24"])
    for _ in range(2):  # the second time from the throttled caller's short memory
        assert_error(server.request_from(ip, unknown, json_body={}, secret="lsk_wrong"), 404,
                     "endpoint_not_found")
        assert_error(server.request_from(ip, disabled.path, json_body={}, secret="lsk_wrong"),
                     403, "endpoint_disabled")
        assert_error(server.request_from(ip, allowlisted.path, json_body={},
                                         secret="lsk_wrong"), 403, "ip_not_allowed")


def test_regenerated_secret_takes_effect_on_the_next_request(server: Server, make_endpoint,
                                                             regenerate, http_env) -> None:
    """On SQLite the very next request; on PostgreSQL the next one after the change
    notification reached the node (docs/architecture.md: delivered after the
    commit returns, so a request sent at that instant may still be answered
    from the node's memory; the bound the docs state is one second).

    (This test used to demand the very next request on PostgreSQL too, which
    the documented bound does not promise: it passed only while the
    notification happened to arrive before the request.)"""
    ep = make_endpoint(source=ECHO)
    assert server.request(ep.path, json_body={}, secret=ep.secret).status == 200  # now cached
    new_secret = regenerate(ep)
    if http_env.database_url.startswith("postgres"):
        deadline = time.monotonic() + 1.0
        while (server.request(ep.path, json_body={}, secret=ep.secret).status == 200
               and time.monotonic() < deadline):
            pass
    for _ in range(3):  # and from then on, every time
        assert_error(server.request(ep.path, json_body={}, secret=ep.secret), 401,
                     "unauthorized")
    assert server.request(ep.path, json_body={}, secret=new_secret).status == 200


def _latency(server: Server, ip: str, path: str, secret: str, n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        resp = server.request_from(ip, path, json_body={"a": 1}, secret=secret)
        times.append(time.perf_counter() - started)
        assert resp.status == 200
    return times


FLOOD = """
import http.client, sys
port, path, ip, n = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
statuses = {}
for i in range(n):
    # A refused request's unread body makes the server close the connection: reconnect.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(ip, 0))
    conn.request("POST", path, body="{}", headers={"Authorization": f"Bearer lsk_wrong{i}",
                                                  "Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    statuses[resp.status] = statuses.get(resp.status, 0) + 1
    conn.close()
print(statuses.get(401, 0), statuses.get(429, 0), n)
"""


def test_wrong_secret_flood_does_not_slow_other_clients(server: Server, make_endpoint,
                                                        source_ip) -> None:
    """A flood of wrong secrets costs the server 20 secret checks, not 1,000.

    What keeps other clients fast is that the flood's requests past the
    throttle are refused before any hashing, while the good client keeps
    being answered. (This test used to compare the good client's median
    latency with and without the flood; on a loaded 2-core host that timing
    failed without any change to the service, so the guarantee is asserted
    by what the server did instead; bench/invoke_bench.py measures speed.)
    """
    ep = make_endpoint(source=ECHO, plan="pro")
    good_ip, bad_ip = source_ip(), source_ip()
    _latency(server, good_ip, ep.path, ep.secret, 20)
    # The flood comes from another process at a lower CPU priority: an attacker's
    # own CPU is on another machine, and on a 2-core test host a full-speed
    # client process would slow this test's client, not only the server under test.
    flood = subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", FLOOD, str(server.port),
                              ep.path, bad_ip, "1000"], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.2)
        assert flood.poll() is None, "the flood ended before it could be measured against"
        _latency(server, good_ip, ep.path, ep.secret, 60)  # every one answered 200
    finally:
        out, _ = flood.communicate(timeout=120)
    unauthorized, throttled, sent = map(int, out.split())
    assert (unauthorized, throttled, sent) == (AUTH_FAILURES_PER_MINUTE, 980, 1000)
