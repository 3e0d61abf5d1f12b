"""Endpoint secrets: generate, hash, verify.

A secret is `lsk_` + 32 random bytes, URL-safe.  Only its verifier and a
4-character hint are stored: `sha256$` + the hex SHA-256 of the secret (one
hash, about a microsecond to check, so the invoke path never waits for a
verification; docs/security.md "Secret verification" says why that is enough
for 256 random bits). Hashes made before this are argon2id strings: they
still verify (tens of milliseconds, off the event loop) and are replaced by
the SHA-256 verifier the first time the right secret is presented
(`upgrade_secret_hash`). the secret itself is returned once to the owner
and never stored, logged or audited.  Only the guild owner may create or
regenerate it; regeneration replaces the hash in one UPDATE, so every node
sees the new hash on its next lookup (and a verification cache keyed by the
hash misses at once).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import secrets as _random
from typing import Any

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

from models import Endpoint, database
from models.clock import iso, utcnow
from service.core import audit
from service.core.access import Actor, Role, guild_and_script
from service.core.errors import PermissionDeniedError

log = logging.getLogger("logic.core")

SECRET_PREFIX = "lsk_"
HINT_CHARS = 4

# Legacy hashes: argon2id with OWASP's baseline parameters (m=19 MiB, t=2, p=1): ~20-30 ms of
# one core per hash. The secret has 256 bits of entropy, so the stretching is
# not what protects it; the cost matters because unknown secrets are hashed
# on the request path (at most 20 per IP per minute, see service.http.ratelimit).
# argon2-cffi's default (t=3, m=64 MiB, p=4) costs ~200 ms here and lets a few
# wrong-secret floods from distinct IPs eat the CPU. Hashes made with other
# parameters still verify: the parameters are stored in each hash.
_hasher = PasswordHasher(time_cost=2, memory_cost=19456, parallelism=1)


def new_secret() -> str:
    """A fresh secret: `lsk_` + `secrets.token_urlsafe(32)`."""
    return SECRET_PREFIX + _random.token_urlsafe(32)


FAST_PREFIX = "sha256$"


def hash_secret(secret: str) -> str:
    """The stored verifier of `secret`: `sha256$` + hex SHA-256."""
    return FAST_PREFIX + hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def hash_secret_argon2(secret: str) -> str:
    """The argon2id hash string of `secret`, as stored before the SHA-256 verifier
    (kept for tests of the migration and of the argon2 queue)."""
    return _hasher.hash(secret)


def is_fast(secret_hash: str | None) -> bool:
    """True for a SHA-256 verifier (checked inline), False for argon2 or nothing."""
    return secret_hash is not None and secret_hash.startswith(FAST_PREFIX)


def verify_fast(secret_hash: str, presented: str) -> bool:
    """Check a SHA-256 verifier in constant time (the caller made sure `is_fast`)."""
    return hmac.compare_digest(secret_hash.encode("ascii", "replace"),
                               hash_secret(presented).encode("ascii"))


def verify_secret(secret_hash: str | None, presented: str) -> bool:
    """True when `presented` matches `secret_hash`.  For an argon2 hash CPU-heavy:
    call it off the event loop.  Never raises for a bad or missing hash."""
    if not secret_hash or not presented:
        return False
    if is_fast(secret_hash):
        return verify_fast(secret_hash, presented)
    try:
        return _hasher.verify(secret_hash, presented)
    except (VerifyMismatchError, VerificationError, InvalidHashError):
        return False


def upgrade_secret_hash(endpoint_id: int, old_hash: str, secret: str) -> bool:
    """Replace a verified argon2 hash by the SHA-256 verifier of the same secret.

    Only while the row still holds `old_hash` (a secret regenerated meanwhile
    is never overwritten); the caller has just verified `secret` against it.
    Returns True when the row changed.
    """
    if is_fast(old_hash):
        return False
    with database.connection_context():
        changed = (Endpoint.update(secret_hash=hash_secret(secret))
                   .where((Endpoint.id == endpoint_id) & (Endpoint.secret_hash == old_hash))
                   .execute())
    if changed:
        log.info("endpoint %s: argon2 secret hash replaced by its SHA-256 verifier", endpoint_id)
    return bool(changed)


def regenerate_secret(actor: Actor, guild_id: str, script_id: str) -> dict[str, Any]:
    """Create or replace the endpoint's secret (owner only) and return it once:
    `{"secret": ..., "hint": ...}`.  Raises `PermissionDeniedError`
    (`owner_only`: operator, manager), `NotFoundError` (also for a stranger)."""
    if actor.is_operator:
        raise PermissionDeniedError(
            "the operator cannot create or regenerate a secret; the guild owner must (--as OWNER_ID)",
            code="owner_only")
    secret = new_secret()
    digest = hash_secret(secret)      # hash before the transaction: keep it short
    hint = secret[-HINT_CHARS:]
    with database.atomic():
        try:
            guild, script, _ = guild_and_script(actor, guild_id, script_id,
                                                "create or regenerate the secret",
                                                allowed=(Role.OWNER,))
        except PermissionDeniedError as err:     # a manager: the refusal names the rule
            raise PermissionDeniedError(err.message + " (owner only)", code="owner_only") from None
        endpoint = Endpoint.get(Endpoint.script == script.id)
        first = endpoint.secret_hash is None
        now = utcnow()
        Endpoint.update(secret_hash=digest, secret_hint=hint, secret_created_at=now,
                        secret_created_by=actor.user_id).where(Endpoint.id == endpoint.id).execute()
        audit.record(actor, "secret.created" if first else "secret.regenerated",
                     guild_id=guild.id, script_id=script.public_id)
    log.info("secret %s for %s by %s", "created" if first else "regenerated",
             script.public_id, actor.label)
    return {"logicScriptId": script.public_id, "secret": secret, "hint": hint,
            "createdAt": iso(now)}
