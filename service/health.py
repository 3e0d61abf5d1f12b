"""`GET /healthz` (the process answers) and `GET /readyz` (database and sandbox usable)."""

from __future__ import annotations

from service.base import BaseHandler
from service.errors import NotReadyError


class HealthHandler(BaseHandler):
    """Liveness: the process is up and its event loop turns."""

    def get(self) -> None:
        self.write_json({"success": True, "status": "ok"})


class ReadyHandler(BaseHandler):
    """Readiness: the database answers and the pool has live workers."""

    def get(self) -> None:
        ctx = self.context
        if ctx.draining:
            raise NotReadyError("The service is shutting down.")
        if not ctx.db_ping():
            raise NotReadyError("The database is not reachable.")
        if ctx.pool.live_workers < 1:
            raise NotReadyError("No sandbox worker is alive.")
        self.write_json({"success": True, "status": "ready", "workers": ctx.pool.live_workers})


routes = [(r"/healthz", HealthHandler), (r"/readyz", ReadyHandler)]
