"""The baseline of `invoke_bench.py`: a bare Tornado handler doing the same work in-process.

Bearer-token check, JSON parse, validation of two fields, JSON reply: the work
unit of ../shared/PERFORMANCE.md, with nothing of Logic Endpoints around it.
Usage: python bench/bare_server.py PORT SECRET
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys

from tornado.web import Application, RequestHandler


class BareHandler(RequestHandler):
    secret = ""

    def post(self, *_: str) -> None:
        auth = self.request.headers.get("Authorization", "")
        if not hmac.compare_digest(auth, "Bearer " + self.secret):
            self.set_status(401)
            self.finish({"success": False})
            return
        try:
            body = json.loads(self.request.body)
        except ValueError:
            self.set_status(400)
            self.finish({"success": False})
            return
        if not isinstance(body, dict) or type(body.get("score")) is not int \
                or type(body.get("player")) is not str:
            self.set_status(422)
            self.finish({"error": "score must be an integer"})
            return
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"ok": True, "double": body["score"] * 2}))


async def main(port: int, secret: str) -> None:
    BareHandler.secret = secret
    app = Application([(r"/endpoints/([^/]+)/([^/]+)", BareHandler)])
    app.listen(port, "127.0.0.1")
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
