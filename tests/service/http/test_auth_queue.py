"""The argon2 queue and the wrong-secret throttle: bounded, fair between
endpoints, per IPv6 /64, and never in the way of a secret already verified."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from service.core.secrets import hash_secret_argon2 as hash_secret, verify_secret
from service.http.auth import SecretVerifier
from tests.service.http.harness import Server, at_once
from tests.service.http.test_checks import ECHO, assert_error


def test_one_endpoints_flood_does_not_delay_another_endpoints_first_secret() -> None:
    # Real argon2 on one thread; the first verification is held so the queue
    # fills in a known order: 6 secrets for endpoint 1, then one for endpoint 2.
    stored = hash_secret("lsk_right")
    order: list[str] = []
    gate = threading.Event()

    def verify(hashed: str, secret: str) -> bool:
        gate.wait(10)
        order.append(secret)
        return verify_secret(hashed, secret)

    async def main() -> list[bool]:
        with ThreadPoolExecutor(max_workers=1) as pool:
            verifier = SecretVerifier(verify, pool, workers=1)
            flood = [asyncio.ensure_future(verifier.check(1, stored, f"lsk_wrong{n}"))
                     for n in range(6)]
            await asyncio.sleep(0.05)
            valid = asyncio.ensure_future(verifier.check(2, stored, "lsk_right"))
            await asyncio.sleep(0.05)
            gate.set()
            return await asyncio.gather(*flood, valid)

    results = asyncio.run(main())
    assert results == [False] * 6 + [True]
    # Endpoint 2 had its turn right after the verification that was running.
    assert order.index("lsk_right") <= 2, order


def test_queue_is_bounded_per_endpoint_before_hashing() -> None:
    stored = hash_secret("lsk_right")
    calls: list[str] = []
    gate = threading.Event()

    def verify(hashed: str, secret: str) -> bool:
        gate.wait(10)
        calls.append(secret)
        return False

    async def main() -> list[object]:
        with ThreadPoolExecutor(max_workers=1) as pool:
            verifier = SecretVerifier(verify, pool, workers=1, max_pending=64, per_endpoint=3)
            tasks = [asyncio.ensure_future(verifier.check(1, stored, f"lsk_w{n}"))
                     for n in range(10)]
            await asyncio.sleep(0.05)
            gate.set()
            return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    busy = [r for r in results if isinstance(r, Exception)]
    assert len(busy) == 6 and all(type(r).__name__ == "VerifierBusy" for r in busy)
    assert len(calls) == 4  # one running and three waiting were hashed, nothing else


def test_full_queue_answers_503_busy_with_retry_after(make_server, make_endpoint,
                                                      source_ip, argon2_secret) -> None:
    server: Server = make_server(extra="[ratelimit]\nauth_queue = 1\nauth_queue_per_endpoint = 1")
    ep = make_endpoint(source=ECHO)
    argon2_secret(ep)  # only a legacy argon2 hash queues (a SHA-256 verifier is inline)
    results: list[int] = []
    busy = []

    def one(n: int) -> None:
        resp = server.request_from(source_ip(), ep.path, json_body={}, secret=f"lsk_wrong{n}")
        results.append(resp.status)
        if resp.status == 503:
            busy.append(resp)

    threads = [threading.Thread(target=one, args=(n,)) for n in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert busy, results
    assert_error(busy[0], 503, "busy")
    assert busy[0].headers["retry-after"] == "1"
    assert set(results) <= {401, 503}


def test_throttled_address_still_gets_its_verified_secret_answered(server: Server,
                                                                   make_endpoint,
                                                                   source_ip) -> None:
    ep = make_endpoint(source=ECHO)
    ip = source_ip()
    assert server.request_from(ip, ep.path, json_body={}, secret=ep.secret).status == 200
    for n in range(21):
        server.request_from(ip, ep.path, json_body={}, secret=f"lsk_wrong{n}")
    assert_error(server.request_from(ip, ep.path, json_body={}, secret="lsk_wrong"), 429,
                 "auth_throttled")
    # The right secret was verified before: checking it again costs no hash.
    assert server.request_from(ip, ep.path, json_body={}, secret=ep.secret).status == 200


def test_ipv6_addresses_of_one_64_share_the_throttle(make_server, make_endpoint) -> None:
    server: Server = make_server(trusted_proxies=["127.0.0.1/32"])
    ep = make_endpoint(source=ECHO)
    statuses = []
    for n in range(21):
        resp = server.request(ep.path, json_body={}, secret=f"lsk_wrong{n}",
                              headers={"X-Forwarded-For": f"2001:db8:1:2::{n + 1:x}"})
        statuses.append(resp.status)
    assert statuses[:20] == [401] * 20
    assert statuses[20] == 429
    # Another /64 is not throttled.
    other = server.request(ep.path, json_body={}, secret="lsk_wrong",
                           headers={"X-Forwarded-For": "2001:db8:1:3::1"})
    assert other.status == 401


def test_a_throttled_address_is_never_let_in_by_a_lookup_from_before_a_change(
        server: Server, make_endpoint, regenerate, source_ip, bind) -> None:
    """A throttled caller's short lookup memory may refuse it, never admit it: the
    old secret of an endpoint whose secret was just regenerated, or of one just
    disabled, is not answered 200 during that memory's second."""
    from service.core import endpoints
    from service.core.access import Actor
    from tests.service.http.conftest import OWNER

    def disable(ep) -> None:
        bind()
        endpoints.disable_endpoint(Actor.user(OWNER), ep.guild_id, ep.script_id)

    for change in (regenerate, disable):
        ep = make_endpoint(source=ECHO)
        ip = source_ip()
        assert server.request_from(ip, ep.path, json_body={}, secret=ep.secret).status == 200
        for n in range(21):
            server.request_from(ip, ep.path, json_body={}, secret=f"lsk_wrong{n}")
        # A change elsewhere: on PostgreSQL the next lookup queries, and the
        # throttled caller's memory keeps its answer for a second.
        make_endpoint(source=ECHO)
        assert server.request_from(ip, ep.path, json_body={}, secret=ep.secret).status == 200
        change(ep)
        time.sleep(0.1)  # the change notification reaches the server
        answers = [server.request_from(ip, ep.path, json_body={}, secret=ep.secret).status
                   for _ in range(5)]
        assert 200 not in answers, (change.__name__, answers)


def test_wrong_secrets_sent_at_once_cannot_outrun_the_throttle(make_server, make_endpoint,
                                                                source_ip, argon2_secret) -> None:
    """The secrets of an address being hashed count with its failures: 40 wrong ones
    sent at once (argon2 takes ~20 ms each, so all would be in flight together) from
    one address get at most 20 hashes, the rest 429; the right secret, hashed from
    another address, still gets in and counts nothing there."""
    # Queues long enough for all of them: only the throttle may refuse.
    server: Server = make_server(extra="[ratelimit]\nauth_queue = 100\n"
                                       "auth_queue_per_endpoint = 100")
    ep = make_endpoint(source=ECHO)
    argon2_secret(ep)  # a legacy argon2 hash: checked on the hashing threads
    ip = source_ip()
    results = at_once(40, lambda n: server.request_from(ip, ep.path, json_body={},
                                                        secret=f"lsk_wrong{n}").status)
    assert len(results) == 40
    assert results.count(401) <= 20, sorted(results)
    assert results.count(401) + results.count(429) == 40, sorted(results)
    assert_error(server.request_from(ip, ep.path, json_body={}, secret="lsk_wrong"), 429,
                 "auth_throttled")
    other = source_ip()
    for n in range(19):
        assert server.request_from(other, ep.path, json_body={}, secret=f"lsk_x{n}").status == 401
    # The right secret, hashed (first use): it counts while hashed, nothing after.
    assert server.request_from(other, ep.path, json_body={}, secret=ep.secret).status == 200
    assert server.request_from(other, ep.path, json_body={}, secret="lsk_x19").status == 401
    assert_error(server.request_from(other, ep.path, json_body={}, secret="lsk_x20"), 429,
                 "auth_throttled")


def test_a_client_sending_its_right_secret_many_times_at_once_is_never_throttled(
        make_server, make_endpoint, source_ip, argon2_secret) -> None:
    """40 requests at once with the right secret, not yet verified (a legacy argon2
    hash: after a restart or a cookie-secret change every endpoint is like this): past
    20 at once they wait for the running checks, which prove right, and none is
    answered 429."""
    server: Server = make_server(extra="[ratelimit]\nauth_queue = 100\n"
                                       "auth_queue_per_endpoint = 100")
    ep = make_endpoint(source=ECHO)
    argon2_secret(ep)
    ip = source_ip()
    results = at_once(40, lambda n: server.request_from(ip, ep.path, json_body={"n": n},
                                                        secret=ep.secret).status)
    assert sorted(results) == [200] * 40
