"""Endpoint secrets: generate, hash, verify.

A secret is `lsk_` + 32 random bytes, URL-safe.  Stored are a 4-character
hint and one string holding two things (docs/security.md "Secret
verification"):

    hmac-sha256$<key id>$<64 hex>$argon2id$v=19$m=19456,t=2,p=1$<salt>$<hash>

- an argon2id hash of the secret (the record at rest);
- a keyed fast verifier: HMAC-SHA256 of the secret under a key derived from
  the configuration's `server.cookie_secret` (about a microsecond to check,
  so the invoke path never waits), tagged with that key's id (the first 8
  hex digits of the key's own SHA-256).

A verifier made under another key (the cookie secret was changed), a bare
argon2id hash (secrets made before verifiers, or by a process with no key)
and a legacy unkeyed `sha256$` digest still verify: the first two through
argon2id (tens of milliseconds, off the event loop), the last by comparing
digests; each is rewritten in the form above the first time the right
secret is presented (`upgrade_secret_hash`), so no unkeyed hash of a secret
that has been used stays stored.  The secret itself is returned once to the
owner and never stored, logged or audited.  Only the guild owner may create
or regenerate it; regeneration replaces the stored string in one UPDATE, so
every node sees it on its next lookup (and a verification cache keyed by
the stored string misses at once).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets as _random
from collections.abc import Callable
from typing import Any

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

from models import Endpoint, database
from models.clock import iso, utcnow
from service.core import audit
from service.core.access import Actor, Role, guild_and_script
from service.core.errors import ConflictError, PermissionDeniedError

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


KEYED_PREFIX = "hmac-sha256$"
LEGACY_PREFIX = "sha256$"
#: Domain separation: the verifier key is not the cookie-signing key itself.
_KEY_LABEL = b"logic-endpoints secret verifier v1"
_KEYED = re.compile(r"hmac-sha256\$([0-9a-f]{8})\$([0-9a-f]{64})(\$argon2id\$.+)", re.S)
_LEGACY = re.compile(r"sha256\$[0-9a-f]{64}")


class _VerifierKey:
    """The keyed verifier's key for this process (none until `configure`)."""

    def __init__(self) -> None:
        self.mac: hmac.HMAC | None = None
        self.kid = ""


_key = _VerifierKey()


def configure(server_secret: str) -> None:
    """Take the verifier key from the configuration's `server.cookie_secret`
    (empty: no key; new hashes are argon2id alone until a keyed process sees them)."""
    if not server_secret:
        _key.mac, _key.kid = None, ""
        return
    key = hmac.new(server_secret.encode("utf-8"), _KEY_LABEL, hashlib.sha256).digest()
    _key.mac = hmac.new(key, digestmod=hashlib.sha256)
    _key.kid = hashlib.sha256(key).hexdigest()[:8]


def _mac_hex(secret: str) -> str:
    assert _key.mac is not None
    mac = _key.mac.copy()
    mac.update(secret.encode("utf-8", "surrogatepass"))
    return mac.hexdigest()


def _with_verifier(argon2_hash: str, secret: str) -> str:
    """`argon2_hash` with the keyed verifier of `secret` in front (the hash alone
    when this process has no key)."""
    if _key.mac is None:
        return argon2_hash
    return f"{KEYED_PREFIX}{_key.kid}${_mac_hex(secret)}{argon2_hash}"


def hash_secret(secret: str) -> str:
    """What is stored for `secret`: keyed verifier + argon2id hash (tens of ms)."""
    return _with_verifier(_hasher.hash(secret), secret)


def hash_secret_argon2(secret: str) -> str:
    """The bare argon2id hash string of `secret` (as stored by a process with no
    key, and before verifiers existed; kept for tests of the upgrade and the queue)."""
    return _hasher.hash(secret)


def is_fast(secret_hash: str | None) -> bool:
    """True when `verify_fast` decides for `secret_hash` without argon2: a keyed
    verifier under this process's key, or a legacy SHA-256 digest."""
    if secret_hash is None:
        return False
    if secret_hash.startswith(KEYED_PREFIX):
        return _key.mac is not None and secret_hash[12:20] == _key.kid
    return secret_hash.startswith(LEGACY_PREFIX)


def verify_fast(secret_hash: str, presented: str) -> bool:
    """Check a verifier in constant time (the caller made sure `is_fast`)."""
    if secret_hash.startswith(LEGACY_PREFIX):
        expected = LEGACY_PREFIX + hashlib.sha256(
            presented.encode("utf-8", "surrogatepass")).hexdigest()
        return hmac.compare_digest(secret_hash.encode("ascii", "replace"),
                                   expected.encode("ascii"))
    return hmac.compare_digest(secret_hash[21:85].encode("ascii", "replace"),
                               _mac_hex(presented).encode("ascii"))


def _argon2_part(secret_hash: str) -> str:
    found = _KEYED.fullmatch(secret_hash)
    return found.group(3) if found else secret_hash


def verify_secret(secret_hash: str | None, presented: str) -> bool:
    """True when `presented` matches `secret_hash`.  Without a verifier under this
    process's key CPU-heavy (argon2id): call it off the event loop.  Never raises
    for a bad or missing hash."""
    if not secret_hash or not presented:
        return False
    if is_fast(secret_hash):
        return verify_fast(secret_hash, presented)
    try:
        return _hasher.verify(_argon2_part(secret_hash), presented)
    except (VerifyMismatchError, VerificationError, InvalidHashError):
        return False


def upgraded_hash(secret_hash: str, secret: str) -> str:
    """What `secret_hash` (just verified against `secret`) should be stored as now:
    the argon2id hash kept (made once for a legacy digest) with a verifier under
    this process's key in front."""
    if _LEGACY.fullmatch(secret_hash):
        return hash_secret(secret)
    return _with_verifier(_argon2_part(secret_hash), secret)


def upgrade_secret_hash(endpoint_id: int, old_hash: str, secret: str,
                        before_write: Callable[[str], object] | None = None) -> str | None:
    """Rewrite a verified hash in the current form (`upgraded_hash`).

    Only while the row still holds `old_hash` (a secret regenerated meanwhile
    is never overwritten); the caller has just verified `secret` against it.
    `before_write(new_hash)` runs before the row is written (the caller
    remembers that `secret` verifies against it too, before anyone can read
    it). Returns the hash now stored when the row changed, else None.
    """
    new_hash = upgraded_hash(old_hash, secret)
    if new_hash == old_hash:
        return None
    if before_write is not None:
        before_write(new_hash)
    with database.connection_context():
        changed = (Endpoint.update(secret_hash=new_hash)
                   .where((Endpoint.id == endpoint_id) & (Endpoint.secret_hash == old_hash))
                   .execute())
    if not changed:
        return None
    log.info("endpoint %s: secret hash rewritten as argon2id with a keyed verifier", endpoint_id)
    return new_hash


def secret_state(secret: dict[str, Any] | None) -> str:
    """Which secret an endpoint has, from its `show_endpoint` view's "secret"
    (`{"createdAt", "hint", ...}` or None): what `regenerate_secret(replaces=...)`
    compares."""
    return "none" if secret is None else f"{secret['createdAt']}/{secret['hint']}"


def regenerate_secret(actor: Actor, guild_id: str, script_id: str, *,
                      replaces: str | None = None) -> dict[str, Any]:
    """Create or replace the endpoint's secret (owner only) and return it once:
    `{"secret": ..., "hint": ...}`.  Raises `PermissionDeniedError`
    (`owner_only`: operator, manager), `NotFoundError` (also for a stranger).

    `replaces`, if given, is the secret the caller means to replace, as
    `"<createdAt>/<hint>"` read before (or `"none"`: no secret yet): when it is no
    longer that one (a form sent twice, another tab regenerated it), nothing
    changes and `ConflictError` (`secret_changed`) is raised, so a resubmitted
    form never kills the secret it has just shown."""
    if actor.is_operator:
        raise PermissionDeniedError(
            "the operator cannot create or regenerate a secret; only the guild owner can",
            code="owner_only")
    secret = new_secret()
    digest = hash_secret(secret)      # hash before the transaction: keep it short
    hint = secret[-HINT_CHARS:]
    with database.atomic():
        try:
            # Locked: two forms naming the same `replaces` at once (two tabs,
            # two front processes) both passed the check below on PostgreSQL,
            # and the secret shown first was dead (red team, session 35).
            guild, script, _ = guild_and_script(actor, guild_id, script_id,
                                                "create or regenerate the secret",
                                                allowed=(Role.OWNER,), lock=True)
        except PermissionDeniedError as err:     # a manager: the refusal names the rule
            raise PermissionDeniedError(err.message + " (owner only)", code="owner_only") from None
        endpoint = Endpoint.get(Endpoint.script == script.id)
        first = endpoint.secret_hash is None
        shown = None if first else {"createdAt": iso(endpoint.secret_created_at),
                                    "hint": endpoint.secret_hint}
        if replaces is not None and replaces != secret_state(shown):
            raise ConflictError("the secret was changed since this page was loaded (in another "
                                "tab, or this form was sent again); nothing was changed now: "
                                "reload the page", code="secret_changed")
        now = utcnow()
        Endpoint.update(secret_hash=digest, secret_hint=hint, secret_created_at=now,
                        secret_created_by=actor.user_id).where(Endpoint.id == endpoint.id).execute()
        audit.record(actor, "secret.created" if first else "secret.regenerated",
                     guild_id=guild.id, script_id=script.public_id)
    log.info("secret %s for %s by %s", "created" if first else "regenerated",
             script.public_id, actor.label)
    return {"logicScriptId": script.public_id, "secret": secret, "hint": hint,
            "createdAt": iso(now)}
