"""Is this request from the platform?  Ed25519 over timestamp + raw body, fresh, once.

The platform signs `X-Signature-Timestamp` + the raw body with its
application key and sends the signature, hex, in `X-Signature-Ed25519`
(discord-interactions-python's `verify_key` checks the same).  This module
checks, before the body is parsed and before the database is touched:

- both headers are present and well-formed, the timestamp is decimal Unix
  seconds no more than five minutes away from now (a captured request cannot
  be replayed later);
- the signature verifies against the configured public key (PyNaCl);
- the interaction's id was not seen in the last ten minutes by this process
  (`first_time`, a memory check before the database's: see
  `service.core.interactions` for every process and node).
"""
from __future__ import annotations

import re
import time
from collections import OrderedDict

from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

#: How far a signature's timestamp may be from now, either way (seconds).
MAX_AGE_S = 300
#: Interaction ids remembered at most (the oldest are forgotten first).
MAX_REMEMBERED = 100_000
_HEX_SIGNATURE = re.compile(r"[0-9a-fA-F]{128}")
_TIMESTAMP = re.compile(r"[0-9]{1,12}")


class SignatureError(Exception):
    """The request is not a fresh, correctly signed one; the message says why
    (for the operator's log; the platform only sees 401)."""


class SignatureVerifier:
    """Checks requests against one application public key (64 hex characters)."""

    def __init__(self, public_key_hex: str, max_age_s: int = MAX_AGE_S) -> None:
        self._key = VerifyKey(bytes.fromhex(public_key_hex))
        self._max_age = max_age_s
        #: How far a timestamp may be from now (seconds), either way.
        self.max_age_s = max_age_s
        self._seen: OrderedDict[str, float] = OrderedDict()

    def verify(self, signature: str | None, timestamp: str | None, body: bytes,
               now: float | None = None) -> None:
        """Raises `SignatureError` unless the request is signed, fresh and well-formed."""
        if not signature or not timestamp:
            raise SignatureError("missing signature header")
        if not _HEX_SIGNATURE.fullmatch(signature) or not _TIMESTAMP.fullmatch(timestamp):
            raise SignatureError("malformed signature header")
        now = time.time() if now is None else now
        if abs(now - int(timestamp)) > self._max_age:
            raise SignatureError("timestamp outside the five-minute window")
        try:
            self._key.verify(timestamp.encode("ascii") + body, bytes.fromhex(signature))
        except BadSignatureError:
            raise SignatureError("bad signature") from None

    def first_time(self, interaction_id: str, now: float | None = None) -> bool:
        """Remember a verified interaction's id; False if it was seen within the window.

        Call only after `verify`: an unsigned request must not fill the memory."""
        now = time.monotonic() if now is None else now
        seen = self._seen
        while seen:
            oldest, when = next(iter(seen.items()))
            if now - when <= 2 * self._max_age and len(seen) < MAX_REMEMBERED:
                break
            del seen[oldest]
        if interaction_id in seen:
            return False
        seen[interaction_id] = now
        return True
