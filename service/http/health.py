"""`GET /healthz` (the process answers) and `GET /readyz` (database and sandbox usable)."""

from __future__ import annotations

import asyncio

from service.http.base import BaseHandler
from service.http.errors import NotReadyError


READY_DB_TIMEOUT_S = 2.0


class HealthHandler(BaseHandler):
    """Liveness: the process is up and its event loop turns."""

    def get(self) -> None:
        self.write_json({"success": True, "status": "ok"})


class ReadyHandler(BaseHandler):
    """Readiness: the database answers and the pool has live workers."""

    async def get(self) -> None:
        ctx = self.context
        if ctx.draining:
            raise NotReadyError("The service is shutting down.")
        # Off the loop and bounded: an unreachable database server must not
        # stall the service while a probe waits for its TCP timeout.
        ping = asyncio.get_running_loop().run_in_executor(None, ctx.db_ping)
        try:
            reachable = await asyncio.wait_for(ping, READY_DB_TIMEOUT_S)
        except asyncio.TimeoutError:
            reachable = False
        if not reachable:
            raise NotReadyError("The database is not reachable.")
        if ctx.pool.live_workers < 1:
            raise NotReadyError("No sandbox worker is alive.")
        self.write_json({"success": True, "status": "ready", "workers": ctx.pool.live_workers})


routes = [(r"/healthz", HealthHandler), (r"/readyz", ReadyHandler)]
