"""Secret verifiers, end to end: argon2id at rest with a keyed verifier checked inline,
older forms rewritten on first use, a changed key falling back to argon2id, and a
regenerated secret dead on the next request whatever was cached."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from argon2 import PasswordHasher

from service.core import secrets
from service.core.secrets import hash_secret, is_fast, verify_secret
from tests.service.http.conftest import CONFIG, stored_secret_hash
from tests.service.http.harness import NOTIFY_BOUND_S, Server
from tests.service.http.test_checks import ECHO, assert_error


def _wait_rewritten(ep, old: str) -> str:
    deadline = time.monotonic() + 20
    while (stored := stored_secret_hash(ep)) == old:   # written in the background
        assert time.monotonic() < deadline, "the stored hash was not rewritten"
        time.sleep(0.05)
    assert stored is not None
    return stored


def test_new_secrets_are_stored_as_argon2id_with_a_keyed_verifier(server: Server, make_endpoint,
                                                                  bind) -> None:
    ep = make_endpoint(source=ECHO)
    bind()
    stored = stored_secret_hash(ep) or ""
    assert stored.startswith("hmac-sha256$") and is_fast(stored)
    argon2_part = stored[stored.index("$argon2id$"):]
    assert PasswordHasher().verify(argon2_part, ep.secret)
    # Neither the secret nor any unkeyed hash of it is stored.
    assert ep.secret not in stored
    assert hashlib.sha256(ep.secret.encode()).hexdigest() not in stored
    assert verify_secret(stored, ep.secret) and not verify_secret(stored, ep.secret + "x")
    assert server.request(ep.path, json_body={}, secret=ep.secret).status == 200
    assert_error(server.request(ep.path, json_body={}, secret=ep.secret[:-1] + "A"
                                if not ep.secret.endswith("A") else ep.secret[:-1] + "B"),
                 401, "unauthorized")


def test_the_verifier_is_keyed_by_the_configured_cookie_secret(monkeypatch) -> None:
    secret = secrets.new_secret()
    stored = hash_secret(secret)
    try:
        secrets.configure("another-cookie-secret-" + "y" * 32)
        # Another key: not decided inline, only by the argon2id hash.
        assert not is_fast(stored)
        assert verify_secret(stored, secret) and not verify_secret(stored, secret + "x")
        assert hash_secret(secret)[12:85] != stored[12:85]
    finally:
        secrets.configure(os.environ["LOGIC_SERVER_COOKIE_SECRET"])
    assert is_fast(stored)


def test_a_legacy_argon2_hash_gets_a_keyed_verifier_on_first_use(server: Server, make_endpoint,
                                                                 argon2_secret, bind) -> None:
    ep = make_endpoint(source=ECHO)
    old = argon2_secret(ep)
    assert old.startswith("$argon2id$") and not is_fast(old)
    assert server.request(ep.path, json_body={}, secret=ep.secret).status == 200
    bind()
    stored = _wait_rewritten(ep, old)
    assert is_fast(stored) and stored.endswith(old)   # the argon2id hash kept as it was
    assert server.request(ep.path, json_body={}, secret=ep.secret).status == 200


def test_a_legacy_unkeyed_digest_is_rewritten_on_first_use(server: Server, make_endpoint,
                                                           bind) -> None:
    from models import Endpoint, Script
    ep = make_endpoint(source=ECHO)
    bind()
    digest = hashlib.sha256(ep.secret.encode()).hexdigest()
    script = Script.get(Script.public_id == ep.script_id)
    Endpoint.update(secret_hash="sha256$" + digest).where(Endpoint.script == script.id).execute()
    assert server.request(ep.path, json_body={}, secret=ep.secret).status == 200
    bind()
    stored = _wait_rewritten(ep, "sha256$" + digest)
    assert stored.startswith("hmac-sha256$") and digest not in stored
    assert PasswordHasher().verify(stored[stored.index("$argon2id$"):], ep.secret)
    assert server.request(ep.path, json_body={}, secret=ep.secret).status == 200


def test_a_server_with_another_cookie_secret_verifies_by_argon2id_and_rewrites(
        http_env, tmp_path: Path, make_endpoint, bind) -> None:
    ep = make_endpoint(source=ECHO)
    bind()
    old = stored_secret_hash(ep) or ""
    config = tmp_path / "other-key.toml"
    config.write_text(f'[records]\njournal = "{tmp_path / "journal"}"\n' + CONFIG)
    other = Server(http_env.database_url, str(config),
                   env={"LOGIC_SERVER_COOKIE_SECRET": "rotated-cookie-secret-" + "z" * 32}).start()
    try:
        assert_error(other.request(ep.path, json_body={}, secret=ep.secret + "x"), 401,
                     "unauthorized")
        assert other.request(ep.path, json_body={}, secret=ep.secret).status == 200
        bind()
        stored = _wait_rewritten(ep, old)
        assert stored[12:20] != old[12:20]                          # the new key's id
        assert stored[85:] == old[85:]                              # the same argon2id hash
        # Outside review, session 21: what this server remembered as verified
        # was the hash it verified, no longer the one the row holds, so an
        # address throttled for wrong secrets then got 429 for the right one.
        ip = "127.0.99.77"   # this server's own throttle: an address no other test uses
        for n in range(21):
            other.request_from(ip, ep.path, json_body={}, secret=f"lsk_wrong{n}")
        assert_error(other.request_from(ip, ep.path, json_body={}, secret="lsk_wrong"), 429,
                     "auth_throttled")
        assert other.request_from(ip, ep.path, json_body={}, secret=ep.secret).status == 200
        assert other.request(ep.path, json_body={}, secret=ep.secret).status == 200
    finally:
        other.stop()


def test_secret_regenerated_while_its_old_argon2_verification_is_cached_stops_working(
        server: Server, http_env, make_endpoint, argon2_secret, regenerate) -> None:
    ep = make_endpoint(source=ECHO)
    argon2_secret(ep)
    # Verified with argon2 and cached in memory (and being upgraded meanwhile).
    assert server.request(ep.path, json_body={}, secret=ep.secret).status == 200
    assert server.request(ep.path, json_body={}, secret=ep.secret).status == 200
    new_secret = regenerate(ep)
    if http_env.database_url.startswith("postgresql"):
        # Dead once the regeneration's notification reached the node: on the
        # next request after it, and on every one after that. (This test used to
        # demand the very next request on PostgreSQL too, more than the docs
        # promise: the notification is delivered after the commit returns, so it
        # failed whenever a loaded host delivered it a few milliseconds late, as
        # test_limits.py's twin of this test once did.)
        deadline = time.monotonic() + NOTIFY_BOUND_S
        while (server.request(ep.path, json_body={}, secret=ep.secret).status == 200
               and time.monotonic() < deadline):
            time.sleep(0.002)
        for _ in range(3):
            assert_error(server.request(ep.path, json_body={}, secret=ep.secret), 401,
                         "unauthorized")
    else:
        # SQLite: the very next request (the lookup checks `data_version` each time).
        assert_error(server.request(ep.path, json_body={}, secret=ep.secret), 401, "unauthorized")
    assert server.request(ep.path, json_body={}, secret=new_secret).status == 200
    assert_error(server.request(ep.path, json_body={}, secret=ep.secret), 401, "unauthorized")


def test_an_old_secret_never_comes_back_through_the_upgrade(server: Server, make_endpoint,
                                                            argon2_secret, regenerate,
                                                            bind) -> None:
    """The upgrade writes only over the hash it verified: a secret regenerated
    before the write lands stays the only one that works."""
    from service.core.secrets import upgrade_secret_hash
    ep = make_endpoint(source=ECHO)
    old = argon2_secret(ep)
    new_secret = regenerate(ep)
    bind()
    from models import Endpoint, Script
    endpoint_id = Endpoint.get(Endpoint.script == Script.get(
        Script.public_id == ep.script_id).id).id
    new_stored = stored_secret_hash(ep)
    assert upgrade_secret_hash(endpoint_id, old, ep.secret) is None
    bind()
    assert stored_secret_hash(ep) == new_stored and verify_secret(new_stored, new_secret)
    assert_error(server.request(ep.path, json_body={}, secret=ep.secret), 401, "unauthorized")
    assert server.request(ep.path, json_body={}, secret=new_secret).status == 200


def test_a_verifier_is_compared_in_constant_time(monkeypatch) -> None:
    """The check goes through `hmac.compare_digest` (not `==`, whose time
    tells how many leading characters matched)."""
    import hmac

    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(secrets.hmac, "compare_digest", spy)
    secret = secrets.new_secret()
    stored = hash_secret(secret)
    assert verify_secret(stored, secret) and not verify_secret(stored, secret + "x")
    assert len(calls) == 2 and calls[0][0] == stored[21:85].encode()
