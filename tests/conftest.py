"""Suite-wide set-up.

`logic serve` refuses to start without `server.cookie_secret` (it signs the
dashboard's sessions).  Every test that starts a server as a subprocess
inherits this environment, so it gets one; a test of the refusal removes it.
Secrets the tests make in their own process get the servers' keyed verifier
(derived from the same cookie secret), as secrets made by a server do.
"""
import os
import secrets

os.environ.setdefault("LOGIC_SERVER_COOKIE_SECRET", "test-" + secrets.token_urlsafe(32))


def _configure_secrets() -> None:
    from service.core import secrets as endpoint_secrets
    endpoint_secrets.configure(os.environ["LOGIC_SERVER_COOKIE_SECRET"])


_configure_secrets()
