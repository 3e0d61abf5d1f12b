"""The OpenAPI 3.1 document: valid, complete, served, and true of the running server
(schemathesis drives every operation from it and checks every answer against it)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from openapi_spec_validator import validate

from service import api
from service.api.spec import METHODS, operation_of
from tests.service.api.conftest import Api
from tests.service.http.harness import wait_until

ST = str(Path(sys.executable).parent / "st")
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance,response_headers_conformance")


def test_document_is_valid_openapi_3_1_and_covers_every_handler_method() -> None:
    doc = api.document()
    validate(doc)     # raises on any violation of the OpenAPI 3.1 schema
    assert doc["openapi"] == "3.1.0"
    for template, handler in api.TEMPLATES:
        defined = {m for m in METHODS if m in vars(handler) or any(
            m in vars(base) for base in handler.__mro__[1:] if base.__module__.startswith("service.api."))}
        assert defined, template
        for method in defined:
            assert operation_of(handler, method) is not None, (method, template)
            assert method in doc["paths"][template], (method, template)
    ops = {(m, p) for p, item in doc["paths"].items() for m in item}
    # The path table of the contract, every row.
    for method, path in [
            ("get", "/api/v1/me"), ("get", "/api/v1/guilds"), ("post", "/api/v1/guilds"),
            ("get", "/api/v1/guilds/{guildId}"), ("patch", "/api/v1/guilds/{guildId}"),
            ("put", "/api/v1/guilds/{guildId}/managers/{userId}"),
            ("delete", "/api/v1/guilds/{guildId}/managers/{userId}"),
            ("get", "/api/v1/guilds/{guildId}/audit"),
            ("get", "/api/v1/guilds/{guildId}/scripts"), ("post", "/api/v1/guilds/{guildId}/scripts"),
            ("get", "/api/v1/guilds/{guildId}/scripts/{scriptId}"),
            ("put", "/api/v1/guilds/{guildId}/scripts/{scriptId}"),
            ("delete", "/api/v1/guilds/{guildId}/scripts/{scriptId}"),
            ("get", "/api/v1/guilds/{guildId}/scripts/{scriptId}/endpoint"),
            ("patch", "/api/v1/guilds/{guildId}/scripts/{scriptId}/endpoint"),
            ("post", "/api/v1/guilds/{guildId}/scripts/{scriptId}/endpoint/secret"),
            ("get", "/api/v1/guilds/{guildId}/scripts/{scriptId}/history"),
            ("get", "/api/v1/guilds/{guildId}/scripts/{scriptId}/history/{requestId}"),
            ("post", "/api/v1/guilds/{guildId}/scripts/{scriptId}/history/{requestId}/replay"),
            ("post", "/api/v1/guilds/{guildId}/scripts/{scriptId}/test"),
            ("get", "/api/v1/guilds/{guildId}/scripts/{scriptId}/errors"),
            ("get", "/api/v1/guilds/{guildId}/scripts/{scriptId}/stats"),
            ("post", "/api/v1/tokens"), ("delete", "/api/v1/tokens/{tokenId}"),
            ("post", "/api/v1/login-links"), ("get", "/api/v1/openapi.json")]:
        assert (method, path) in ops, (method, path)
    # The error codes of the contract are documented where they can happen.
    script = doc["paths"]["/api/v1/guilds/{guildId}/scripts/{scriptId}"]["put"]["responses"]
    assert {"412", "422", "404", "403", "401"} <= set(script)
    secret = doc["paths"]["/api/v1/guilds/{guildId}/scripts/{scriptId}/endpoint/secret"]["post"]
    assert "Cache-Control" in secret["responses"]["201"]["headers"]


def test_server_serves_the_same_document_without_a_token(server) -> None:
    resp = Api(server, None)("GET", "/openapi.json")
    assert resp.status == 200 and resp.json == api.document()


def test_schemathesis_finds_no_5xx_and_no_nonconforming_answer(server, world, tmp_path) -> None:
    w = world()         # a guild and a script exist, so some generated calls reach them
    url = f"http://127.0.0.1:{server.port}/api/v1/openapi.json"
    proc = subprocess.run(
        [ST, "run", url, "-H", f"Authorization: Bearer {w.operator.token}", "-n", "10",
         "--seed", "12", "-c", CHECKS, "--no-color", "--generation-database", "none",
         # Revoking random token ids could revoke the token the run uses (tested directly).
         "--exclude-operation-id", "revokeToken", "--request-timeout", "30"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail


def test_who_of_every_guild_read_is_what_the_server_allows(world) -> None:
    """Each guild-scoped read's "Who:" line names exactly the roles that get it:
    those listed are answered 200, the others refused (403, or 404 for a
    stranger, who learns nothing). A red-team pass found `listAudit`
    documented as "owner, manager" while operators read it."""
    w = world()
    tried = w.owner("POST", w.script_path + "/test", {"body": {"a": 1}})
    assert tried.status == 200, tried.body
    request_id = tried.json["requestId"]
    assert wait_until(lambda: w.owner("GET", f"{w.script_path}/history/{request_id}").status
                      == 200)
    values = {"guildId": w.guild_id, "scriptId": w.script_id, "requestId": request_id}
    callers = {"owner": w.owner, "manager": w.manager, "operator": w.operator,
               "stranger": w.stranger}
    checked = 0
    for template, item in api.document()["paths"].items():
        op = item.get("get")
        if op is None or "{guildId}" not in template:
            continue
        who = op["description"].split("Who:", 1)[1].split(".", 1)[0]
        allowed = {role.strip() for role in who.split(",")}
        assert allowed <= set(callers), (template, who)
        path = template.removeprefix("/api/v1").format(**values)
        for role, call in callers.items():
            status = call("GET", path).status
            if role in allowed:
                assert status == 200, (template, role, status)
            else:
                assert status in (403, 404), (template, role, status)
        checked += 1
    assert checked >= 9
