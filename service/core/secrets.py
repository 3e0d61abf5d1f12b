"""Endpoint secrets: generate, hash (argon2id), verify (DESIGN section 7).

A secret is `lsk_` + 32 random bytes, URL-safe.  Only its argon2id hash and a
4-character hint are stored; the secret itself is returned once to the owner
and never stored, logged or audited.  Only the guild owner may create or
regenerate it; regeneration replaces the hash in one UPDATE, so every node
sees the new hash on its next lookup (and a verification cache keyed by the
hash misses at once).
"""
from __future__ import annotations

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

# argon2id with OWASP's baseline parameters (m=19 MiB, t=2, p=1): ~20-30 ms of
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


def hash_secret(secret: str) -> str:
    """The argon2id hash string of `secret`."""
    return _hasher.hash(secret)


def verify_secret(secret_hash: str | None, presented: str) -> bool:
    """True when `presented` matches `secret_hash`.  CPU-heavy (argon2):
    call it off the event loop.  Never raises for a bad or missing hash."""
    if not secret_hash or not presented:
        return False
    try:
        return _hasher.verify(secret_hash, presented)
    except (VerifyMismatchError, VerificationError, InvalidHashError):
        return False


def regenerate_secret(actor: Actor, guild_id: str, script_id: str) -> dict[str, Any]:
    """Create or replace the endpoint's secret (owner only) and return it once:
    `{"secret": ..., "hint": ...}`.  Raises `PermissionDeniedError` (operator,
    manager, stranger), `NotFoundError`."""
    if actor.is_operator:
        raise PermissionDeniedError(
            "the operator cannot create or regenerate a secret; the guild owner must (--as OWNER_ID)",
            code="owner_only")
    secret = new_secret()
    digest = hash_secret(secret)      # hash before the transaction: keep it short
    hint = secret[-HINT_CHARS:]
    with database.atomic():
        guild, script, _ = guild_and_script(actor, guild_id, script_id,
                                            "create or regenerate the secret",
                                            allowed=(Role.OWNER,))
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
