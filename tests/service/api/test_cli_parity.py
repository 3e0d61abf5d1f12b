"""The CLI and the API agree: one scenario through both, the JSON compared."""
from __future__ import annotations

import json
import re
import subprocess
from typing import Any

from tests.service.api.conftest import ECHO, Api
from tests.service.http.harness import LOGIC, wait_until

OWNER, MANAGER = "8100", "8200"
_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
_VARYING = {"id", "requestId", "durationMs", "avgMs", "secret", "hint", "createdAt",
            "updatedAt", "time", "latency", "perMinute", "perHour", "date", "x-request-id",
            "ratelimit-reset"}


def normalise(value: Any, ids: dict[str, str]) -> Any:
    """The JSON with what must differ between two runs (ids, times, durations) masked."""
    if isinstance(value, dict):
        return {k: "<varies>" if k in _VARYING else normalise(v, ids) for k, v in value.items()}
    if isinstance(value, list):
        return [normalise(v, ids) for v in value]
    if isinstance(value, str):
        for real, alias in ids.items():
            value = value.replace(real, alias)
        # The base URL follows each process's --port; the path must agree.
        value = re.sub(r"^https?://[^/]+/", "<base>/", value)
        return "<time>" if _TIME.match(value) else value
    return value


def test_cli_and_api_give_the_same_json(server, http_env, make_token, tmp_path) -> None:
    source = tmp_path / "echo.logic"
    source.write_text(ECHO)

    def cli(*args: str, as_user: str | None = None) -> Any:
        cmd = [LOGIC, "--database-url", http_env.database_url, "--config", str(http_env.config),
               *args, "--json"] + (["--as", as_user] if as_user else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    op = Api(server, make_token(None)["token"])
    owner, manager = op.as_user(OWNER), op.as_user(MANAGER)

    def api(who: Api, method: str, path: str, body: Any = None, status: int = 200) -> Any:
        resp = who(method, path, body)
        assert resp.status == status, resp.body
        return resp.json

    g_cli, g_api = "91001", "91002"
    out: dict[str, list[Any]] = {"cli": [], "api": []}
    out["cli"].append(cli("guild", "create", g_cli, "--owner", OWNER, "--plan", "pro"))
    out["api"].append(api(op, "POST", "/guilds", {"guildId": g_api, "ownerId": OWNER,
                                                  "plan": "pro"}, 201))
    out["cli"].append(cli("guild", "add-manager", g_cli, MANAGER, as_user=OWNER))
    out["api"].append(api(owner, "PUT", f"/guilds/{g_api}/managers/{MANAGER}"))
    s_cli = cli("script", "create", g_cli, "--name", "echo", "--file", str(source),
                as_user=MANAGER)
    s_api = api(manager, "POST", f"/guilds/{g_api}/scripts", {"name": "echo", "source": ECHO}, 201)
    out["cli"].append(s_cli)
    out["api"].append(s_api)
    sc, sa = s_cli["logicScriptId"], s_api["logicScriptId"]
    pa = f"/guilds/{g_api}/scripts/{sa}"
    out["cli"].append(cli("script", "show", g_cli, sc, as_user=MANAGER))
    out["api"].append(api(manager, "GET", pa))
    out["cli"].append(cli("endpoint", "enable", g_cli, sc, as_user=MANAGER))
    out["api"].append(api(manager, "PATCH", pa + "/endpoint", {"enabled": True}))
    out["cli"].append(cli("whitelist", "set", g_cli, sc, "127.0.0.0/8", as_user=OWNER))
    out["api"].append(api(owner, "PATCH", pa + "/endpoint", {"whitelist": ["127.0.0.0/8"]}))
    secret_cli = cli("secret", "regenerate", g_cli, sc, as_user=OWNER)
    secret_api = api(owner, "POST", pa + "/endpoint/secret", None, 201)
    out["cli"].append(secret_cli)
    out["api"].append(secret_api)
    out["cli"].append(cli("endpoint", "show", g_cli, sc, as_user=MANAGER))
    out["api"].append(api(manager, "GET", pa + "/endpoint"))
    for gid, sid, secret in ((g_cli, sc, secret_cli["secret"]), (g_api, sa, secret_api["secret"])):
        resp = server.request(f"/endpoints/{gid}/{sid}", json_body={"n": 1}, secret=secret,
                              headers={"User-Agent": "parity"})
        assert resp.status == 200
    assert wait_until(lambda: len(api(manager, "GET", pa + "/history")["items"]) == 1)
    assert wait_until(lambda: len(cli("history", g_cli, sc, as_user=MANAGER)["records"]) == 1)
    assert wait_until(lambda: api(manager, "GET", pa + "/stats")["total"] == 1)
    assert wait_until(lambda: cli("stats", g_cli, sc, as_user=MANAGER)["total"] == 1)
    out["cli"].append(cli("history", g_cli, sc, as_user=MANAGER)["records"])
    out["api"].append(api(manager, "GET", pa + "/history")["items"])
    out["cli"].append(cli("stats", g_cli, sc, as_user=MANAGER))
    out["api"].append(api(manager, "GET", pa + "/stats"))
    out["cli"].append(cli("guild", "show", g_cli, as_user=OWNER))
    out["api"].append(api(owner, "GET", f"/guilds/{g_api}"))
    ids_cli, ids_api = {g_cli: "G", sc: "S"}, {g_api: "G", sa: "S"}
    for step, (c, a) in enumerate(zip(out["cli"], out["api"])):
        assert normalise(c, ids_cli) == normalise(a, ids_api), step
    # The same refusal, with the same code and message, through both.
    proc = subprocess.run([LOGIC, "--database-url", http_env.database_url, "secret", "regenerate",
                           g_cli, sc, "--as", MANAGER], capture_output=True, text=True, timeout=60)
    refused = manager("POST", pa + "/endpoint/secret").json["error"]
    assert proc.returncode != 0 and refused["code"] == "owner_only"
    assert proc.stderr.strip().endswith(refused["message"].replace(g_api, g_cli).replace(sa, sc))
