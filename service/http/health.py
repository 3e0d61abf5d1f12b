"""`GET /healthz` (the process answers) and `GET /readyz` (each dependency's state).

Both answer `HEAD` too (the same status and headers, no body), as probes
that only look at the status often send.

`/readyz` answers JSON naming every dependency and whether it is up:
`database` (a ping, off the loop and bounded; on PostgreSQL also whether the
change feed is listening), `ratelimit` (memory, or Redis and its policy),
`sandbox` (live workers) and `records` (waiting to be written, dropped).
It answers 503 `not_ready` — a load balancer's signal to send the node no
new traffic — when the database does not answer, when no sandbox worker is
alive, when Redis is down under `ratelimit.on_storage_error = "closed"` (the
node refuses invoke requests then), and while draining. Redis down under
"open" keeps it 200: the node admits requests under its own windows.
Meanwhile the invoke path keeps answering what it can decide
(docs/deployment.md, "What an outage does").
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from service.http.base import BaseHandler, error_body
from service.http.errors import NotReadyError


READY_DB_TIMEOUT_S = 2.0


class HealthHandler(BaseHandler):
    """Liveness: the process is up and its event loop turns."""

    def get(self) -> None:
        self.write_json({"success": True, "status": "ok"})

    head = get


class ReadyHandler(BaseHandler):
    """Readiness: every dependency's state; 503 when the node should get no traffic."""

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
        database: dict[str, Any] = {"state": "up" if reachable else "down"}
        if ctx.change_feed is not None:
            database["changeFeed"] = "listening" if ctx.change_feed.healthy else "lost"
        await ctx.limits.probe_storage()   # bounded by ratelimit.storage_timeout_ms
        limits = ctx.limits.storage_state()
        workers = ctx.pool.live_workers
        records = ctx.records
        dependencies = {
            "database": database,
            "ratelimit": limits,
            "sandbox": {"state": "up" if workers >= 1 else "down", "workers": workers},
            "records": {"state": "waiting" if records.database_down or not reachable else "up",
                        "pending": records.pending,
                        "dropped": records.dropped},
        }
        why = None
        if not reachable:
            why = "The database is not reachable."
        elif workers < 1:
            why = "No sandbox worker is alive."
        elif limits["state"] == "down" and limits.get("onError") == "closed":
            why = "The rate-limit storage is not reachable."
        if why is None:
            self.write_json({"success": True, "status": "ready", "workers": workers,
                             "dependencies": dependencies})
            return
        # The one error shape, plus what is down.
        envelope = json.loads(error_body("not_ready", why, self.request_id))
        self.error_code = "not_ready"
        self.write_json({**envelope, "dependencies": dependencies}, status=503)

    head = get


routes = [(r"/healthz", HealthHandler), (r"/readyz", ReadyHandler)]
