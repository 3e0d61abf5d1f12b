"""The handler inside a Tornado `Application` with XSRF protection on (as the
Dashboard needs it): the platform's signature, not an XSRF cookie, admits a
request.  In-process, because `logic serve`'s own Application settings are
not this module's to change; the end-to-end tests cover the rest."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

from nacl.signing import SigningKey
from tornado.testing import AsyncHTTPTestCase
from tornado.web import Application

from service.chat.handler import routes
from service.settings import load_settings


class XsrfAppTest(AsyncHTTPTestCase):
    key = SigningKey.generate()

    def get_app(self) -> Application:
        settings = load_settings(None, {"LOGIC_CHAT_PUBLIC_KEY": self.key.verify_key.encode().hex()},
                                 {})
        context: Any = SimpleNamespace(settings=settings)
        return Application(routes(context), xsrf_cookies=True)

    def test_signed_ping_passes_without_an_xsrf_cookie(self) -> None:
        body = json.dumps({"type": 1}).encode()
        ts = str(int(time.time()))
        headers = {"X-Signature-Ed25519": self.key.sign(ts.encode() + body).signature.hex(),
                   "X-Signature-Timestamp": ts, "Content-Type": "application/json"}
        resp = self.fetch("/interactions", method="POST", body=body, headers=headers)
        assert resp.code == 200 and json.loads(resp.body) == {"type": 1}
        resp = self.fetch("/interactions", method="POST", body=body,
                          headers={"Content-Type": "application/json"})
        assert resp.code == 401
