"""Issue 17 as a script author and an operator meet it: the real `logic` command
(subprocess) against a real `logic serve` on loopback, on SQLite.

Save-time checks, versions and rollback, the version in history and error
records, readable history/errors/stats with filters, next steps and URL
warnings, plan changes with --dry-run and the whitelist, and the hint for a
JSON body sent without a JSON content type."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.service.http.harness import LOGIC, Server, wait_until

V1 = """\
on endpoint(event):
    if event.body == {"fail": True}:
        boom = {}
        print("about to fail")
        event.reply(boom["missing"])
    event.reply({"v": 1, "body": event.body})
"""
V2 = "on endpoint(event):\n    event.reply({'v': 2})\n"
ANSI = "\x1b["


class Cli:
    def __init__(self, url: str, cwd: Path, config: Path | None = None) -> None:
        self.url, self.cwd, self.config = url, cwd, config

    def run(self, *args: str, code: int = 0, stdin: str = "") -> subprocess.CompletedProcess[str]:
        argv = [LOGIC, "--database-url", self.url]
        if self.config:
            argv += ["--config", str(self.config)]
        proc = subprocess.run([*argv, *args], cwd=self.cwd, capture_output=True, text=True,
                              timeout=60, input=stdin)
        assert proc.returncode == code, (args, proc.returncode, proc.stdout, proc.stderr)
        if code:
            assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
        assert ANSI not in proc.stdout       # not a terminal: no colour codes
        return proc

    def out(self, *args: str) -> str:
        return self.run(*args).stdout

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "--json").stdout)


@pytest.fixture()
def env(tmp_path: Path) -> tuple[Cli, Path]:
    config = tmp_path / "logic.toml"
    config.write_text("[sandbox]\nworkers = 1\n")
    cli = Cli(f"sqlite:///{tmp_path}/logic.db", tmp_path, config)
    cli.run("db", "upgrade")
    cli.run("guild", "create", "1", "--owner", "10", "--plan", "pro")
    return cli, tmp_path


def _file(tmp: Path, name: str, text: str) -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


def test_save_time_checks_refuse_with_line_and_column_and_warn(env: tuple[Cli, Path]) -> None:
    cli, tmp = env
    syntax = cli.run("script", "check", _file(tmp, "syn.py", "on endpoint(e):\n    x = (\n"), code=2)
    bad = cli.run("script", "check", _file(tmp, "os.py", "import json\nimport os\non endpoint(e):\n"
                                                          "    e.reply(1)\n"), code=2)
    # Same exit code and format as a syntax error.
    assert syntax.stderr.startswith("logic: error: script does not compile: ")
    assert bad.stderr.startswith("logic: error: script does not compile: 2:1: import of 'os' is "
                                 "not allowed (allowed: base64, ")
    empty = cli.run("script", "check", _file(tmp, "empty.py", "# nothing yet\n\n"), code=2)
    assert "1:1: script is empty" in empty.stderr
    undefined = cli.run("script", "check", _file(tmp, "u.py", "on endpoint(e):\n    e.reply(prnt(1))\n"
                                                              "    open('x')\n"), code=2)
    assert "2:13: prnt() is not defined" in undefined.stderr and "3:5: open()" in undefined.stderr
    fine = cli.run("script", "check", _file(tmp, "own.py", "def helper(x):\n    return x\n"
                                                          "on endpoint(e):\n    e.reply(helper(len([])))\n"))
    assert fine.stdout.endswith(": ok\n") and fine.stderr == ""
    # Refused at save exactly as by check: nothing is created.
    cli.run("script", "create", "1", "--name", "x", "--file", str(tmp / "os.py"), code=2)
    assert cli.json("script", "list", "1") == {"scripts": []}

    tick = _file(tmp, "tick.py", "on tick(e):\n    pass\n")
    created = cli.run("script", "create", "1", "--name", "ticker", "--file", tick)
    warnings = created.stderr.splitlines()
    assert warnings == [
        'logic: warning: 1:1: no "on endpoint(event):" block: every call of this script\'s '
        "endpoint will answer 501 no_endpoint_handler",
        'logic: warning: 1:1: "on tick" never runs here: this service only emits endpoint']
    sid = created.stdout.strip()
    stored = cli.json("script", "show", "1", sid)["warnings"]
    assert [w["message"][:20] for w in stored] == ['no "on endpoint(even', '"on tick" never runs']
    # A duplicate name in the guild is refused; the first script keeps it.
    dup = cli.run("script", "create", "1", "--name", "ticker", "--file", tick, code=2)
    assert dup.stderr == f"logic: error: guild 1 already has a script named 'ticker' ({sid})\n"
    other = cli.run("script", "create", "1", "--name", "other", "--file", tick).stdout.strip()
    cli.run("script", "update", "1", other, "--name", "ticker", code=2)


def test_versions_history_errors_and_stats_read_well(env: tuple[Cli, Path]) -> None:
    cli, tmp = env
    sid = cli.json("script", "create", "1", "--name", "scores", "--file",
                   _file(tmp, "v1.py", V1))["logicScriptId"]
    enabled = cli.run("endpoint", "enable", "1", sid)
    # The owner's id, so that the line runs as it is (a placeholder before).
    assert f"logic secret regenerate 1 {sid} --as 10" in enabled.stdout
    assert re.search(r"^secret\s+none yet$", enabled.stdout, re.M)
    assert "server.base_url is not configured" in enabled.stderr
    secret = cli.json("secret", "regenerate", "1", sid, "--as", "10")["secret"]
    ready = cli.out("endpoint", "show", "1", sid)
    assert "logic secret regenerate" not in ready and "clients POST to the URL" in ready

    server = Server(cli.url, str(cli.config)).start()
    try:
        path = f"/endpoints/1/{sid}"
        ok = server.request(path, json_body={"score": 1}, secret=secret)
        assert ok.status == 200 and ok.json == {"v": 1, "body": {"score": 1}}
        assert "x-logic-hint" not in {k.lower() for k in ok.headers}
        # JSON without a JSON content type: the event keeps the form, the reply says why.
        form = server.request(path, body='{"score": 1}', secret=secret,
                              headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert form.status == 200 and form.json == {"v": 1, "body": {'{"score": 1}': ""}}
        hint = {k.lower(): v for k, v in form.headers.items()}["x-logic-hint"]
        assert hint.startswith('body was parsed as form data because Content-Type was '
                               '"application/x-www-form-urlencoded"; it is valid JSON')
        failed = server.request(path, json_body={"fail": True}, secret=secret)
        assert failed.status == 500

        cli.run("script", "update", "1", sid, "--file", _file(tmp, "v2.py", V2))
        assert server.request(path, json_body={}, secret=secret).json == {"v": 2}
        versions = cli.json("script", "versions", "1", sid)
        assert [v["version"] for v in versions["versions"]] == [2, 1]
        assert {v["author"] for v in versions["versions"]} == {"operator"}
        assert versions["versions"][1]["sourceBytes"] == len(V1.encode())
        table = cli.out("script", "versions", "1", sid)
        assert re.search(r"^2 \(current\)\s+\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\s+operator\s+\d+ B$",
                         table, re.M), table
        rolled = cli.json("script", "rollback", "1", sid, "1", "--as", "10")
        assert rolled["version"] == 3 and rolled["restoredFrom"] == 1
        assert cli.json("script", "show", "1", sid)["source"] == V1
        assert server.request(path, json_body={}, secret=secret).json == {"v": 1, "body": {}}
        cli.run("script", "rollback", "1", sid, "99", code=2)

        assert wait_until(lambda: len(cli.json("history", "1", sid)["records"]) == 5, 20)
        records = cli.json("history", "1", sid)["records"]
        assert [r["scriptVersion"] for r in records] == [3, 2, 1, 1, 1]
        for key in ("id", "time", "method", "status", "ip", "userAgent", "query", "headers", "body",
                    "responseBody", "durationMs", "output", "error"):
            assert all(key in r for r in records)
        failing = records[2]
        assert failing["status"] == 500

        text = cli.out("history", "1", sid)
        lines = text.splitlines()
        assert re.split(r"\s{2,}", lines[0]) == ["TIME", "REQUEST ID", "METHOD", "STATUS", "DURATION",
                                                  "IP", "VERSION", "ERROR"]
        assert len(lines) == 6 and all(re.search(r" \d+\.\d ms ", line) for line in lines[1:])
        starts = {line.index("POST") for line in lines[1:]}
        assert len(starts) == 1                           # aligned columns
        assert cli.json("history", "1", sid, "--status", "5xx")["records"] == [failing]
        assert len(cli.json("history", "1", sid, "--status", "2xx")["records"]) == 4
        assert cli.json("history", "1", sid, "--status", "500")["records"] == [failing]
        assert len(cli.json("history", "1", sid, "--limit", "2")["records"]) == 2
        assert len(cli.json("history", "1", sid, "--since", "1h")["records"]) == 5
        assert cli.json("history", "1", sid, "--since", "2999-01-01")["records"] == []
        bad = cli.run("history", "1", sid, "--status", "6xx", code=2).stderr
        assert "invalid status filter '6xx'" in bad
        assert "--since" in cli.run("history", "1", sid, "--since", "yesterday", code=2).stderr

        shown = cli.out("history", "show", "1", sid, failing["requestId"])
        assert f"request         {failing['requestId']}" in shown
        assert "script version  1" in shown and '  {"fail": true}' in shown
        assert "output:\n  about to fail" in shown
        assert re.search(r"error record: script_error at line 5: .*'missing'", shown), shown
        full = cli.json("history", "show", "1", sid, failing["requestId"])
        assert full["errorRecord"]["line"] == 5 and full["scriptVersion"] == 1
        cli.run("history", "show", "1", sid, "nope", code=2)
        # A request id that is not UTF-8 on the command line (red-team pass,
        # session 23: a 72-line traceback from the database driver): one line.
        odd = cli.run("history", "show", "1", sid, "req_\udcff", code=2).stderr
        assert odd.count("\n") == 1 and "Traceback" not in odd and "no request" in odd, odd

        errors = cli.json("errors", "1", sid)["errors"]
        assert len(errors) == 1 and errors[0]["scriptVersion"] == 1 and errors[0]["line"] == 5
        etext = cli.out("errors", "1", sid).splitlines()
        assert re.split(r"\s{2,}", etext[0]) == ["TIME", "REQUEST ID", "KIND", "LINE", "VERSION"]
        assert "\\n" not in "".join(etext)                # tracebacks as lines
        assert any(line.startswith("    ") and "line 5" in line for line in etext[2:]), etext
        assert cli.json("errors", "1", sid, "--status", "4xx")["errors"] == []
        assert len(cli.json("errors", "1", sid, "--status", "5xx", "--since", "1h")["errors"]) == 1

        stats = cli.out("stats", "1", sid)
        assert re.search(r"^requests \(30 days\)\s+5$", stats, re.M), stats
        assert re.search(r"^latency \(24 h\)\s+p50 \d+\.\d ms  p90 \d+\.\d ms  p99 \d+\.\d ms  "
                         r"\(5 requests, within 1 %\)$", stats, re.M), stats
    finally:
        server.stop()


HOSTILE = """\
on endpoint(event):
    print("\\x1b]0;pwned\\x07\\x1b[2J\\rforged line \\u202eevil \\u061cmark")
    raise ValueError("\\x1b]52;c;Y3VybCBldmlsIHwgc2g=\\x07\\x9b31m"
                     "\\n2026-01-01 00:00:00  req_FAKE  timeout  9  1")
"""


def test_what_scripts_and_callers_wrote_reaches_the_terminal_inert(env: tuple[Cli, Path]) -> None:
    # Security review, session 16: `logic errors` and `history show` printed
    # a script's escape sequences raw: on the operator's terminal they set
    # the window title, cleared the screen, wrote the clipboard (OSC 52).
    cli, tmp = env
    sid = cli.json("script", "create", "1", "--name", "hostile", "--file",
                   _file(tmp, "h.py", HOSTILE))["logicScriptId"]
    cli.run("endpoint", "enable", "1", sid)
    secret = cli.json("secret", "regenerate", "1", sid, "--as", "10")["secret"]
    server = Server(cli.url, str(cli.config)).start()
    try:
        answer = server.request(f"/endpoints/1/{sid}", body="\x1b]0;caller\x07", secret=secret,
                                headers={"Content-Type": "text/plain"})
        assert answer.status == 500
        assert wait_until(lambda: len(cli.json("errors", "1", sid)["errors"]) == 1, 20)
        request_id = cli.json("errors", "1", sid)["errors"][0]["requestId"]
        for args in (("errors", "1", sid), ("history", "1", sid),
                     ("history", "show", "1", sid, request_id)):
            shown = cli.out(*args)
            assert not any(c in shown for c in "\x1b\x07\r\x7f\x9b\u202e\u061c"), (args, shown)
            # A newline in what the script wrote starts no row of its own.
            assert not any(line.startswith("2026-01-01") for line in shown.splitlines()), shown
        shown = cli.out("errors", "1", sid)
        assert "ValueError: \\x1b]52;c;Y3VybCBldmlsIHwgc2g=\\x07\\x9b31m" in shown, shown
        record = cli.out("history", "show", "1", sid, request_id)
        assert "\\x1b]0;pwned\\x07\\x1b[2J\\x0dforged line" in record, record
        assert "\\x1b]0;caller\\x07" in record and "\\u202eevil" in record, record
        assert "\\u061cmark" in record, record     # the Arabic letter mark reorders text too
        # --json stays exact (every control character escaped by JSON itself).
        full = cli.json("history", "show", "1", sid, request_id)
        assert full["output"].startswith("\x1b]0;pwned\x07")
    finally:
        server.stop()


def test_percentiles_are_the_recorded_durations_not_bucket_bounds(env: tuple[Cli, Path]) -> None:
    """The issue's case: calls of 1.03-2.04 s used to read p50 = p90 = p99 = 2500."""
    from datetime import timedelta

    from models import Endpoint, Script
    from models.clock import utcnow
    from models.db import connect, database
    from service.core.records import StatHit, write_batch

    cli, tmp = env
    sid = cli.json("script", "create", "1", "--name", "slow", "--file",
                   _file(tmp, "s.py", V2))["logicScriptId"]
    db = connect(cli.url)
    try:
        endpoint = Endpoint.get(Endpoint.script == Script.get(Script.public_id == sid).id)
        durations = [1030.0 + 10.1 * i for i in range(101)]       # 1030 .. 2040 ms
        now = utcnow() - timedelta(minutes=1)
        write_batch([StatHit(endpoint.id, now, 200, d, "192.0.2.1") for d in durations])
    finally:
        db.close()
        database.initialize(None)
    latency = cli.json("stats", "1", sid)["latency"]
    for p, rank in (("p50", 50), ("p90", 90), ("p99", 99)):
        real = durations[rank]
        assert abs(latency[p] - real) <= 0.01 * real, (p, latency[p], real)
    assert latency["relativeError"] == 0.01 and latency["count"] == 101


def test_plan_change_dry_run_whitelist_and_audit(env: tuple[Cli, Path]) -> None:
    cli, tmp = env
    config = tmp / "logic.toml"
    config.write_text('[sandbox]\nworkers = 1\n[server]\nbase_url = "https://logic.example"\n')
    src = _file(tmp, "v2.py", V2)
    first = cli.json("script", "create", "1", "--name", "a", "--file", src)["logicScriptId"]
    second = cli.json("script", "create", "1", "--name", "b", "--file", src)["logicScriptId"]
    for sid in (first, second):
        shown = cli.run("endpoint", "enable", "1", sid)
        assert shown.stderr == ""                     # base_url configured: no warning
        assert re.search(rf"^url\s+https://logic.example/endpoints/1/{sid}$", shown.stdout, re.M)
    secret = cli.json("secret", "regenerate", "1", first, "--as", "10")["secret"]
    cli.run("whitelist", "set", "1", first, "127.0.0.2/32")

    dry = cli.out("guild", "set-plan", "1", "free", "--dry-run")
    assert "plan would change from pro to free" in dry
    assert f"endpoints that would be disabled (over the quota of 0): {second}, {first}" in dry
    assert f"IP whitelists kept but no longer enforced: {first}" in dry
    assert "ip_whitelist: True -> False" in dry and "(dry run: nothing was changed)" in dry
    guild = cli.json("guild", "show", "1")
    assert guild["plan"] == "pro" and guild["endpointsEnabled"] == 2
    preview = cli.json("guild", "set-plan", "1", "plus", "--dry-run")
    assert preview["dryRun"] is True and preview["disabled"] == []
    assert preview["whitelistsSuspended"] == [first]

    server = Server(cli.url, str(config)).start()
    try:
        path = f"/endpoints/1/{first}"
        assert server.request(path, json_body={}, secret=secret).code == "ip_not_allowed"
        cli.run("guild", "set-plan", "1", "plus")
        # plus has no whitelist feature: the stored one is kept, not enforced.
        assert server.request(path, json_body={}, secret=secret).status == 200
        shown = cli.json("endpoint", "show", "1", first)
        assert shown["whitelist"] == ["127.0.0.2/32"] and shown["whitelistEnforced"] is False
        assert "(kept, not enforced: plan plus has no IP whitelist)" in cli.out("endpoint", "show", "1", first)
        cli.run("guild", "set-plan", "1", "pro")
        assert server.request(path, json_body={}, secret=secret).code == "ip_not_allowed"
    finally:
        server.stop()

    audit = cli.json("guild", "audit", "1")["audit"]
    changes = [a["detail"] for a in audit if a["action"] == "plan.changed"]
    assert changes[0]["old"] == "plus" and changes[0]["new"] == "pro"
    assert changes[0]["whitelists_resumed"] == [first]
    assert changes[1]["changes"]["ip_whitelist"] == {"old": True, "new": False}
    text = cli.out("guild", "audit", "1").splitlines()
    assert re.split(r"\s{2,}", text[0]) == ["TIME", "ACTOR", "ACTION", "SCRIPT", "DETAIL"]
    assert any("plan.changed" in line and "plus -> pro" in line for line in text)
    listed = cli.out("guild", "list").splitlines()
    assert re.split(r"\s{2,}", listed[0]) == ["GUILD", "PLAN", "OWNER", "ENDPOINTS", "MANAGERS", "CREATED"]
    assert re.split(r"\s{2,}", listed[1])[:4] == ["1", "pro", "10", "2/9"]
    scripts = cli.out("script", "list", "1").splitlines()
    assert re.split(r"\s{2,}", scripts[0]) == ["ID", "NAME", "VERSION", "ENDPOINT", "UPDATED"]
    assert re.split(r"\s{2,}", scripts[1])[:4] == [first, "a", "1", "on"]


def test_malformed_numbers_and_times_are_one_line_errors(env: tuple[Cli, Path]) -> None:
    cli, tmp = env
    sid = cli.json("script", "create", "1", "--name", "s", "--file",
                   _file(tmp, "v2.py", V2))["logicScriptId"]
    for since in ("0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-01:00", "999999999d"):
        for command in ("history", "errors"):
            refused = cli.run(command, "1", sid, "--since", since, code=2)
            assert "out of range" in refused.stderr or "years 1 to 9999" in refused.stderr
    for status in ("²00", "\u0665\u0660\u0660"):          # superscript two; Arabic-Indic 500
        assert "invalid status filter" in cli.run("history", "1", sid, "--status", status,
                                                  code=2).stderr
    made = cli.json("token", "create", "--operator")
    arabic = "".join(chr(0x660 + int(d)) for d in str(made["id"]))
    assert "not found" in cli.run("token", "revoke", arabic, code=2).stderr
    assert "not found" in cli.run("token", "revoke", "²", code=2).stderr
    assert cli.json("token", "revoke", str(made["id"])) == {"id": made["id"], "revoked": True}
