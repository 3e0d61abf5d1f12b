"""The test console and replay of the Endpoints tab.

A test call runs through the invoke pipeline (plan body size, the endpoint's
quota, body parsing, the sandbox, history, error log and statistics) without
the secret: the session's role authorises it (`service.core.testcalls`), and
`service.http.testcall.run_test_call` runs it.  It is marked as a test call
in history and statistics.  The result is rendered on the page, as text.
"""
from __future__ import annotations

import json
from typing import Any

from service.core import testcalls
from service.core.errors import CoreError, NotFoundError, PermissionDeniedError
from service.dashboard.base import PageError
from service.dashboard.scripts import ScriptHandler
from service.http.errors import ServiceError
from service.http.event import MAX_BODY_VALUES, client_ip, too_many_values
from service.http.testcall import run_test_call

METHODS = ("POST", "PUT", "PATCH", "DELETE", "GET")


def parse_headers(text: str) -> dict[str, str]:
    """`Name: value` lines as a dict; raises `ValueError` naming the bad line."""
    headers: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        name, sep, value = line.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"header line {number} is not 'Name: value'")
        headers[name.strip()] = value.strip()
    return headers


class ConsoleHandler(ScriptHandler):
    """`POST .../test` (the console's form) and `POST .../replay` (a history record)."""

    async def post(self, guild_id: str, script_id: str) -> None:
        form = {k: self.get_body_argument(k, "") for k in ("method", "headers", "kind", "query")}
        # The body as typed (Tornado strips an argument's surrounding whitespace
        # by default): a text body's spaces and final newline are the test's.
        form["body"] = self.get_body_argument("body", "", strip=False).replace("\r\n", "\n")
        form["method"] = form["method"] or "POST"
        form["kind"] = "text" if form["kind"] == "text" else "json"
        try:
            headers = parse_headers(form["headers"])
            if form["kind"] == "json" and form["body"].strip():
                # Counted first: decoding it builds an object a value, on the
                # event loop (the invoke path's cap, service/http/event.py).
                if too_many_values(form["body"]):
                    raise ValueError(f"the JSON body holds more than {MAX_BODY_VALUES:,} values")
                json.loads(form["body"])
                headers.setdefault("Content-Type", "application/json")
        except ValueError as err:
            await self.show_console(guild_id, script_id, form, error=f"Not sent: {err}.")
            return
        except RecursionError:
            await self.show_console(guild_id, script_id, form,
                                    error="Not sent: the JSON body is nested too deeply.")
            return
        plans = self.dashboard.settings.plans
        try:
            request = await self.core_raw(testcalls.new_test_request, form["method"], headers,
                                          form["body"] if form["body"] else None, form["query"])
            target = await self.core(testcalls.test_target, self.actor, guild_id, script_id,
                                     plans=plans)
        except CoreError as err:
            await self.show_console(guild_id, script_id, form, error=f"Not sent: {err.message}")
            return
        await self.run(guild_id, script_id, target, request, form)

    async def run(self, guild_id: str, script_id: str, target: Any,
                  request: testcalls.TestRequest, form: dict[str, str]) -> None:
        ip = client_ip(self.request.remote_ip or "", self.request.headers.get("X-Forwarded-For"),
                       self.context.settings.server.trusted_proxies)
        try:
            result = await run_test_call(self.context, target, request, ip=ip,
                                         request_id=self.request_id)
        except ServiceError as err:
            await self.show_console(guild_id, script_id, form, result={
                "status": err.status, "error": err.code, "headers": err.headers,
                "body": json.dumps({"success": False, "error": {
                    "code": err.code, "message": err.message, "requestId": self.request_id}}),
                "bodyEncoding": "text", "durationMs": 0.0, "output": "",
                "requestId": self.request_id, "replayOf": request.replay_of})
            return
        await self.show_console(guild_id, script_id, form, result=result.response())

    async def show_console(self, guild_id: str, script_id: str, form: dict[str, str], *,
                           result: dict[str, Any] | None = None,
                           error: str | None = None) -> None:
        await self.show(guild_id, script_id, status=200 if result else 400,
                        console={"form": form, "result": result, "error": error})


class ReplayHandler(ConsoleHandler):
    """`POST .../replay`: run a history record again, as a test call."""

    async def post(self, guild_id: str, script_id: str) -> None:
        request_id = self.get_body_argument("request_id", "")
        form = {"method": "POST", "headers": "", "body": "", "kind": "json", "query": ""}
        try:
            target, request = await self.core_raw(testcalls.replay_request, self.actor, guild_id,
                                                  script_id, request_id,
                                                  plans=self.dashboard.settings.plans)
        except (NotFoundError, PermissionDeniedError) as err:
            if err.code not in ("request_not_found",):
                raise PageError(404, "Not found.") from None    # a stranger learns nothing
            await self.show_console(guild_id, script_id, form, error=f"Not replayed: {err.message}")
            return
        except CoreError as err:
            await self.show_console(guild_id, script_id, form, error=f"Not replayed: {err.message}")
            return
        form["headers"] = "\n".join(f"{k}: {v}" for k, v in request.headers.items())
        form["body"] = request.body.decode("utf-8", "replace")
        form["query"] = request.query
        await self.run(guild_id, script_id, target, request, form)
