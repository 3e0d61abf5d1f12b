"""`SignatureVerifier`: Ed25519 over timestamp + raw body, a five-minute window, each id once."""
from __future__ import annotations

import pytest
from nacl.signing import SigningKey

from service.chat.signature import MAX_AGE_S, SignatureError, SignatureVerifier

NOW = 1_800_000_000
BODY = b'{"type":1}'


@pytest.fixture()
def key() -> SigningKey:
    return SigningKey.generate()


def sign(key: SigningKey, ts: str, body: bytes) -> str:
    return key.sign(ts.encode() + body).signature.hex()


def test_a_correct_signature_passes(key: SigningKey) -> None:
    verifier = SignatureVerifier(key.verify_key.encode().hex())
    verifier.verify(sign(key, str(NOW), BODY), str(NOW), BODY, now=NOW)
    # Upper-case hex is the same signature.
    verifier.verify(sign(key, str(NOW), BODY).upper(), str(NOW), BODY, now=NOW)


@pytest.mark.parametrize("case", ["missing signature", "missing timestamp", "other key",
                                  "altered body", "signed other timestamp", "old", "future",
                                  "short signature", "timestamp not decimal"])
def test_every_failure_is_refused(key: SigningKey, case: str) -> None:
    verifier = SignatureVerifier(key.verify_key.encode().hex())
    ts, body, sig = str(NOW), BODY, sign(key, str(NOW), BODY)
    now: float = NOW
    if case == "missing signature":
        sig = ""
    elif case == "missing timestamp":
        ts = ""
    elif case == "other key":
        sig = sign(SigningKey.generate(), ts, body)
    elif case == "altered body":
        body = b'{"type":2}'
    elif case == "signed other timestamp":
        ts = str(NOW + 1)
    elif case == "old":
        ts = str(NOW - MAX_AGE_S - 1)
        sig = sign(key, ts, body)
    elif case == "future":
        ts = str(NOW + MAX_AGE_S + 1)
        sig = sign(key, ts, body)
    elif case == "short signature":
        sig = sig[:-2]
    elif case == "timestamp not decimal":
        ts = f"{NOW}.0"
        sig = sign(key, ts, body)
    with pytest.raises(SignatureError):
        verifier.verify(sig or None, ts or None, body, now=now)


def test_the_window_edge_is_inclusive(key: SigningKey) -> None:
    verifier = SignatureVerifier(key.verify_key.encode().hex())
    ts = str(NOW - MAX_AGE_S)
    verifier.verify(sign(key, ts, BODY), ts, BODY, now=NOW)


def test_an_id_is_accepted_once_within_the_window(key: SigningKey) -> None:
    verifier = SignatureVerifier(key.verify_key.encode().hex())
    assert verifier.first_time("1", now=0.0)
    assert not verifier.first_time("1", now=10.0)
    assert verifier.first_time("2", now=10.0)
    # Long after the window the id is forgotten (a signature that old fails anyway).
    assert verifier.first_time("1", now=10.0 + 2 * MAX_AGE_S + 1)
