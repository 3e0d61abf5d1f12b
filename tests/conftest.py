"""Suite-wide set-up.

`logic serve` refuses to start without `server.cookie_secret` (it signs the
dashboard's sessions).  Every test that starts a server as a subprocess
inherits this environment, so it gets one; a test of the refusal removes it.
"""
import os
import secrets

os.environ.setdefault("LOGIC_SERVER_COOKIE_SECRET", "test-" + secrets.token_urlsafe(32))
