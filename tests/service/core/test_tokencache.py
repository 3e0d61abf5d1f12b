"""The token cache: hits need no query, and never outlive a revocation or an expiry."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from models.db import is_postgres, open_database
from service import core
from service.core.tokencache import RevocationListener, TokenCache
from tests.factories import OPERATOR
from tests.service.http.harness import wait_until


def _cached(cache: TokenCache, token: str):
    hit = cache.get(token)
    if hit is None:
        stamp = cache.stamp()
        found = cache.lookup(token)
        if found is not None:
            cache.put(token, found, stamp)
    return cache.get(token)


def test_a_hit_runs_no_query_and_a_revocation_elsewhere_ends_it(db, monkeypatch) -> None:
    cache = TokenCache()
    listener = None
    if is_postgres(db):
        listener = cache.listener = RevocationListener(db, retry_s=0.2)
        listener.start()
        assert wait_until(lambda: listener.listening)
    try:
        made = core.create_api_token(OPERATOR, "100")
        identity = _cached(cache, made["token"])
        assert identity is not None and identity.actor == core.Actor.user("100")
        # A hit: no lookup at all (the lookup would fail loudly here).
        monkeypatch.setattr("service.core.tokencache.lookup_api_token",
                            lambda t: pytest.fail("looked up on a hit"))
        assert cache.get(made["token"]) == identity
        monkeypatch.undo()
        # Revoked through another connection (another process or node would do the same).
        if is_postgres(db):
            other = type(db)(db.database, **db.connect_params)
        else:
            other = open_database(f"sqlite:///{db.database}")
        from models.db import database
        database.initialize(other)
        core.revoke_api_token(OPERATOR, made["id"])
        database.initialize(db)
        other.close()
        if is_postgres(db):
            assert wait_until(lambda: cache.get(made["token"]) is None, timeout=5)
        else:
            assert cache.get(made["token"]) is None          # the very next check
        assert cache.lookup(made["token"]) is None
    finally:
        if listener is not None:
            listener.stop()


def test_without_a_listener_postgres_never_trusts_the_cache(db) -> None:
    if not is_postgres(db):
        pytest.skip("PostgreSQL only: SQLite has data_version")
    cache = TokenCache()
    made = core.create_api_token(OPERATOR, "100")
    stamp = cache.stamp()
    cache.put(made["token"], cache.lookup(made["token"]), stamp)   # type: ignore[arg-type]
    assert cache.get(made["token"]) is None


def test_expiry_is_checked_on_every_hit(db) -> None:
    cache = TokenCache()
    if is_postgres(db):
        pytest.skip("the expiry check is the same code on both backends")
    soon = datetime.now(timezone.utc) + timedelta(hours=1)
    made = core.create_api_token(OPERATOR, "100", expires_at=soon)
    identity = _cached(cache, made["token"])
    assert identity is not None and identity.expires_at is not None
    object.__setattr__(identity, "expires_at", identity.expires_at - timedelta(hours=2))
    assert cache.get(made["token"]) is None
    with pytest.raises(core.ValidationError):
        core.create_api_token(OPERATOR, "100", expires_at=soon - timedelta(hours=2))
