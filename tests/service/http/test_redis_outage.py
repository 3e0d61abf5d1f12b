"""A slow or stopped Redis under the rate limit, against a PRIVATE redis-server.

- a Redis that does not answer (frozen with SIGSTOP: slower than any timeout
  the test could pick, and no timing in the assertions) stalls only the
  requests waiting for it: /healthz and requests that need no Redis call are
  answered meanwhile;
- `ratelimit.on_storage_error = "open"`: with Redis stopped, requests are
  admitted under the node's own windows (which still refuse past the limit),
  one warning per outage, and Redis's windows are used again once it is back;
- `"closed"`: 503 `busy` while it is stopped, 200 once it is back.

These tests do not depend on the database: SQLite only.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.service.http.harness import Response, Server
from tests.service.http.private_servers import (PrivateRedis, dependency_down, poll,
                                                unread_bytes_on)

pytestmark = pytest.mark.parametrize("http_env", ["sqlite"], indirect=True)

ECHO = "on endpoint(event):\n    event.reply({'ok': True})\n"
DOWN = "rate-limit storage unreachable"
BACK = "rate-limit storage reachable again"


@pytest.fixture()
def redis_server() -> Iterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed: no private Redis can be started")
    server = PrivateRedis().start()
    yield server
    server.stop()


def _config(redis: PrivateRedis, on_error: str, timeout_ms: int) -> str:
    return (f'[ratelimit]\nstorage = "{redis.url}"\non_storage_error = "{on_error}"\n'
            f"storage_timeout_ms = {timeout_ms}\n")


def _window_keys(redis: PrivateRedis) -> list[Any]:
    return list(redis.client().keys("LIMITS:LIMITER/logic-*/ep:*"))


def test_two_installations_sharing_one_redis_keep_apart_windows(
        make_server: Callable[..., Server], make_endpoint: Callable[..., Any],
        redis_server: PrivateRedis, tmp_path: Path) -> None:
    """Outside review, session 24: the Redis keys named only the endpoint's
    id, so two installations (two databases) on one Redis server shared the
    windows of their endpoints with the same id: callers of one used up the
    other's quota. Keys are now named after the installation's id, made
    when its database is created."""
    from models.db import connect, database
    from models.installation import installation_id
    from models.migrate import Runner
    ep = make_endpoint(ECHO, plan="bench")
    ours = installation_id()
    srv = make_server(extra=_config(redis_server, "open", 1000))
    assert srv.request(ep.path, secret=ep.secret, json_body={}).status == 200
    keys = [k.decode() for k in _window_keys(redis_server)]
    assert keys and all(k.startswith(f"LIMITS:LIMITER/logic-{ours}/") for k in keys), keys
    bound = database.obj
    other = connect(f"sqlite:///{tmp_path}/other.db")   # another installation's database
    try:
        Runner(other).upgrade()
        theirs = installation_id()
    finally:
        other.close()
        database.initialize(bound)
    assert len(theirs) == 16 and theirs != ours and installation_id() == ours


def test_a_redis_that_does_not_answer_stalls_only_the_requests_that_wait_for_it(
        make_server: Callable[..., Server], make_endpoint: Callable[..., Any],
        redis_server: PrivateRedis) -> None:
    ep = make_endpoint(ECHO, plan="bench")
    srv = make_server(extra=_config(redis_server, "open", 600_000))
    assert srv.request(ep.path, secret=ep.secret, json_body={}).status == 200  # connected, warm
    assert _window_keys(redis_server), "the request was counted in Redis"

    redis_server.freeze()
    answers: list[Response] = []
    waiting = threading.Thread(target=lambda: answers.append(
        srv.request(ep.path, secret=ep.secret, json_body={}, timeout=120)))
    waiting.start()
    try:
        # The service's command has reached the frozen Redis: it waits for it now.
        assert poll(lambda: unread_bytes_on(redis_server.port) > 0, 30)
        assert srv.request("/healthz", method="GET").status == 200
        nothing = srv.request(f"/endpoints/{ep.guild_id}/not-a-script-id", json_body={})
        assert nothing.status == 404 and nothing.code == "endpoint_not_found"
        assert not answers, "the invoke request did not wait for Redis"
    finally:
        redis_server.thaw()
    waiting.join(60)
    assert [a.status for a in answers] == [200]
    # Slow is not down while within storage_timeout_ms.
    assert srv.request("/readyz", method="GET").json["dependencies"]["ratelimit"]["state"] == "up"
    assert DOWN not in srv.log


def _script_calls(redis: PrivateRedis) -> int:
    stats = redis.client().info("commandstats")
    return sum(int(stats.get(name, {}).get("calls", 0)) for name in ("cmdstat_evalsha",
                                                                      "cmdstat_eval"))


def test_a_verified_caller_costs_one_redis_call_per_request(
        make_server: Callable[..., Server], make_endpoint: Callable[..., Any],
        redis_server: PrivateRedis) -> None:
    ep = make_endpoint(ECHO, plan="bench")
    srv = make_server(extra=_config(redis_server, "open", 1000))
    assert srv.request(ep.path, secret=ep.secret, json_body={}).status == 200  # secret verified
    before = _script_calls(redis_server)
    answers = [srv.request(ep.path, secret=ep.secret, json_body={}) for _ in range(10)]
    assert [a.status for a in answers] == [200] * 10
    assert [a.headers["ratelimit-remaining"] for a in answers] == [
        str(1_000_000 - n) for n in range(2, 12)]            # counted in Redis, one each
    assert _script_calls(redis_server) - before == 10
    # A wrong secret still checks the throttle first, looks at its count again when
    # its check starts (fresh: other requests may have failed meanwhile), and counts
    # the failure.
    wrong = srv.request(ep.path, secret="wrong", json_body={})
    assert wrong.status == 401
    assert _script_calls(redis_server) - before == 13


def test_fail_open_admits_under_the_nodes_own_windows_and_recovers(
        make_server: Callable[..., Server], make_endpoint: Callable[..., Any],
        redis_server: PrivateRedis, source_ip: Callable[[], str]) -> None:
    limited = make_endpoint(ECHO, plan="plus")  # 30 per minute
    ep = make_endpoint(ECHO, plan="bench")
    srv = make_server(extra=_config(redis_server, "open", 1000))
    first = srv.request(ep.path, secret=ep.secret, json_body={})
    assert first.status == 200
    assert srv.request("/readyz", method="GET").json["dependencies"]["ratelimit"]["state"] == "up"

    redis_server.stop()
    answers = [srv.request(ep.path, secret=ep.secret, json_body={}) for _ in range(20)]
    assert [a.status for a in answers] == [200] * 20
    # The node's own window still holds the limit: 30 admitted, the 31st refused.
    statuses = [srv.request(limited.path, secret=limited.secret, json_body={}).status
                for _ in range(31)]
    assert statuses == [200] * 30 + [429]
    # So does the wrong-secret throttle: 20 failures from an address, then 429.
    attacker = source_ip()
    wrong = [srv.request_from(attacker, ep.path, secret="wrong", json_body={}).status
             for _ in range(21)]
    assert wrong == [401] * 20 + [429]
    assert poll(lambda: DOWN in srv.log), srv.log  # the log arrives through a pipe
    assert srv.log.count(DOWN) == 1, srv.log  # once, for 72 requests
    ready = srv.request("/readyz", method="GET")
    assert ready.status == 200, "open: the node still answers, so it stays in the pool"
    assert ready.json["dependencies"]["ratelimit"]["state"] == "down"

    redis_server.start()  # the same port, empty
    assert poll(lambda: srv.request(ep.path, secret=ep.secret, json_body={}).status == 200
                and bool(_window_keys(redis_server)), 30)
    assert poll(lambda: BACK in srv.log)
    assert srv.log.count(BACK) == 1 and srv.log.count(DOWN) == 1
    assert srv.request("/readyz", method="GET").json["dependencies"]["ratelimit"]["state"] == "up"


def test_ready_says_a_redis_down_at_start_is_down_before_any_request(
        make_server: Callable[..., Server], redis_server: PrivateRedis) -> None:
    """Review, session 25: a node started while Redis was down (fail closed)
    answered /readyz 200 "up" until a request first tried Redis, so a load
    balancer sent it traffic it could only refuse. /readyz asks Redis itself."""
    redis_server.stop()
    srv = make_server(extra=_config(redis_server, "closed", 500))
    ready = srv.request("/readyz", method="GET")
    assert ready.status == 503 and ready.json["dependencies"]["ratelimit"]["state"] == "down"
    redis_server.start()
    assert poll(lambda: srv.request("/readyz", method="GET").status == 200, 30)


def test_fail_closed_refuses_with_busy_until_redis_is_back(
        make_server: Callable[..., Server], make_endpoint: Callable[..., Any],
        redis_server: PrivateRedis) -> None:
    ep = make_endpoint(ECHO, plan="bench")
    srv = make_server(extra=_config(redis_server, "closed", 1000))
    assert srv.request(ep.path, secret=ep.secret, json_body={}).status == 200

    redis_server.stop()
    refused = [srv.request(ep.path, secret=ep.secret, json_body={}) for _ in range(5)]
    assert [r.status for r in refused] == [503] * 5
    assert {r.code for r in refused} == {"busy"}
    assert all(r.headers.get("retry-after") == "1" for r in refused)
    assert poll(lambda: DOWN in srv.log)
    assert srv.log.count(DOWN) == 1
    ready = srv.request("/readyz", method="GET")
    assert ready.status == 503 and ready.json["dependencies"]["ratelimit"]["state"] == "down"
    assert dependency_down(srv, "ratelimit") == 1 and dependency_down(srv, "database") == 0

    redis_server.start()
    assert poll(lambda: srv.request(ep.path, secret=ep.secret, json_body={}).status == 200, 30)
    assert poll(lambda: BACK in srv.log)
    assert srv.log.count(BACK) == 1 and srv.log.count(DOWN) == 1
    assert dependency_down(srv, "ratelimit") == 0



def test_wrong_secrets_sent_at_once_are_checked_at_most_twenty_times_with_redis(
        make_server: Callable[..., Server], make_endpoint: Callable[..., Any],
        redis_server: PrivateRedis, source_ip: Callable[[], str]) -> None:
    """With the windows in Redis every check of the allowance is a network round trip,
    so requests interleave between looking and counting: the checks of an address
    running in this process count too, so 60 wrong secrets sent at once still get at
    most 20 answers of 401, the rest 429; and 60 right ones sent at once all get in."""
    from tests.service.http.harness import at_once
    ep = make_endpoint(ECHO, plan="bench")
    srv = make_server(extra=_config(redis_server, "open", 2000))
    ip = source_ip()
    wrong = at_once(60, lambda n: srv.request_from(ip, ep.path, json_body={},
                                                   secret=f"lsk_wrong{n}").status)
    assert wrong.count(401) <= 20 and wrong.count(401) + wrong.count(429) == 60, sorted(wrong)
    other = source_ip()
    right = at_once(60, lambda n: srv.request_from(other, ep.path, json_body={},
                                                   secret=ep.secret).status)
    assert sorted(right) == [200] * 60
