"""The installed `logic` command, driven through subprocess with --json.

One scenario per backend keeps the count of processes (about 0.15 s each)
low while covering every command and every error exit code."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from models.migrate import discover

LOGIC = str(Path(sys.executable).with_name("logic"))
VERSIONS = [m.version for m in discover()]
LATEST = VERSIONS[-1]
SOURCE = "on endpoint(event):\n    event.reply({'ok': True})\n"


class Logic:
    """Runs `logic --database-url URL ...` and checks exit code and output."""

    def __init__(self, url: str, cwd: Path, env: dict[str, str] | None = None) -> None:
        self.url, self.cwd = url, cwd
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("LOGIC_")}
        self.env.update(env or {})

    def __call__(self, *args: str, code: int = 0, url: bool = True, stdin: str = "") -> Any:
        argv = [LOGIC, *(["--database-url", self.url] if url else []), *args]
        proc = subprocess.run(argv, cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=60, input=stdin)
        assert proc.returncode == code, (args, proc.returncode, proc.stdout, proc.stderr)
        if code:
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("logic: error: "), proc.stderr
            assert proc.stdout == ""
            return lines[0]
        if "--json" in args:
            assert proc.stdout.count("\n") == 1, proc.stdout      # exactly one object
            return json.loads(proc.stdout)
        return proc.stdout


def scenario(logic: Logic, tmp_path: Path) -> None:
    src = tmp_path / "s.py"
    src.write_text(SOURCE)
    behind = logic("guild", "create", "1", "--owner", "10", "--json", code=1)
    assert behind.endswith(f'database schema is at version 0, this release needs {LATEST}: '
                           'run "logic db upgrade"')
    assert logic("db", "upgrade", "--json")["applied"] == VERSIONS
    assert logic("db", "upgrade", "--json") == {"applied": [], "from": LATEST, "to": LATEST}

    assert logic("guild", "create", "1", "--owner", "10", "--json")["plan"] == "free"
    logic("guild", "create", "1", "--owner", "10", "--json", code=2)            # exists
    logic("guild", "create", "1x", "--owner", "10", "--json", code=2)           # bad id
    logic("guild", "add-manager", "1", "20", "--as", "10", "--json")
    logic("guild", "add-manager", "1", "21", "--as", "20", "--json", code=3)    # manager
    assert [g["guildId"] for g in logic("guild", "list", "--as", "20", "--json")["guilds"]] == ["1"]
    sid = logic("script", "create", "1", "--name", "hello", "--file", str(src), "--json")["logicScriptId"]
    assert sid.startswith("logic_") and len(sid) == 28
    assert logic("script", "list", "1", "--json")["scripts"][0]["logicScriptId"] == sid
    other = logic("script", "create", "1", "--name", "stdin", "--file", "-", "--json", stdin=SOURCE)
    assert logic("script", "show", "1", other["logicScriptId"], "--json")["source"] == SOURCE
    logic("script", "create", "1", "--name", "x", "--file", str(tmp_path / "missing.py"), code=2)

    quota = logic("endpoint", "enable", "1", sid, "--as", "20", "--json", code=4)   # free: 0
    assert quota == "logic: error: plan free does not include endpoints"   # exit 4, as a quota
    logic("guild", "set-plan", "1", "plus", "--json")
    logic("guild", "set-plan", "1", "gold", "--json", code=2)
    shown = logic("endpoint", "enable", "1", sid, "--as", "20", "--json")
    assert shown["enabled"] is True and shown["url"] == f"http://127.0.0.1:8080/endpoints/1/{sid}"
    refused = logic("secret", "regenerate", "1", sid, "--json", code=3)
    assert "operator" in refused and refused.endswith("(run it with --as 10)")   # the owner, runnable as is
    logic("secret", "regenerate", "1", sid, "--as", "20", "--json", code=3)
    secret = logic("secret", "regenerate", "1", sid, "--as", "10", "--json")
    assert secret["secret"].startswith("lsk_") and secret["hint"] == secret["secret"][-4:]
    assert logic("endpoint", "show", "1", sid, "--json")["secret"]["hint"] == secret["hint"]
    logic("whitelist", "set", "1", sid, "10.0.0.0/8", "--json", code=4)          # plus: no
    logic("guild", "set-plan", "1", "pro", "--json")
    logic("whitelist", "set", "1", sid, "10.0.0.1/8", "--json", code=2)          # host bits
    assert logic("whitelist", "set", "1", sid, "10.0.0.0/8", "--as", "20", "--json")["whitelist"] == ["10.0.0.0/8"]

    assert logic("history", "1", sid, "--json") == {"records": []}
    assert logic("errors", "1", sid, "--as", "10", "--json") == {"errors": []}
    assert logic("stats", "1", sid, "--json")["total"] == 0
    # A stranger is told what a missing guild would tell: nothing about guild 1.
    assert logic("history", "1", sid, "--as", "99", "--json", code=2) == (
        "logic: error: guild 1 not found")
    logic("history", "1", "logic_" + "z" * 22, "--json", code=2)                 # not found
    logic("history", "2", sid, "--json", code=2)

    src.write_text(SOURCE + "# v2\n")
    assert logic("script", "update", "1", sid, "--file", str(src), "--json")["version"] == 2
    assert logic("script", "show", "1", sid, "--json")["source"].endswith("# v2\n")
    assert logic("guild", "set-plan", "1", "free", "--json")["disabled"] == [sid]
    assert logic("token", "create", "--user", "10", "--json")["token"].startswith("lat_")
    assert logic("token", "create", "--operator", "--json")["kind"] == "operator"
    logic("token", "create", "--json", code=2)
    # Text mode: the token alone on stdout, its id (to revoke it) on stderr.
    made = subprocess.run([LOGIC, "--database-url", logic.url, "token", "create", "--user", "10"],
                          cwd=logic.cwd, env=logic.env, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 and made.stdout.startswith("lat_")
    assert made.stdout.count("\n") == 1 and made.stdout.strip() not in made.stderr
    token_id = made.stderr.split("token id ", 1)[1].split(":", 1)[0]
    assert logic("token", "revoke", token_id, "--json") == {"id": int(token_id), "revoked": True}
    link = logic("login-link", "10", "--json")["url"]
    assert link.startswith("http://127.0.0.1:8080/login/")
    # The link uses a base URL nobody configured: said on stderr, as for endpoint URLs.
    made = subprocess.run([LOGIC, "--database-url", logic.url, "login-link", "10"],
                          cwd=logic.cwd, env=logic.env, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 and made.stdout.startswith("http://127.0.0.1:8080/login/")
    assert made.stderr.startswith("logic: warning: server.base_url is not configured")
    assert logic("script", "delete", "1", sid, "--json")["deleted"] is True
    actions = [a["action"] for a in logic("guild", "audit", "1", "--as", "10", "--json")["audit"]]
    assert actions[0] == "script.deleted" and "secret.created" in actions
    logic("script", "show", "1", sid, "--json", code=2)
    logic("no-such-command", code=2)


def test_cli_on_sqlite(tmp_path):
    (tmp_path / "logic.db").touch()   # an empty database (a missing file: test_a_mistyped_...)
    scenario(Logic(f"sqlite:///{tmp_path}/logic.db", tmp_path), tmp_path)


def test_cli_on_postgresql(pg_empty_url, tmp_path):
    scenario(Logic(pg_empty_url, tmp_path), tmp_path)


def test_env_config_file_and_text_output(tmp_path):
    config = tmp_path / "logic.toml"
    config.write_text(f'[database]\nurl = "sqlite:///{tmp_path}/c.db"\n'
                      '[server]\nbase_url = "https://logic.example"\n')
    logic = Logic("", tmp_path, env={"LOGIC_CONFIG": str(config)})
    assert f"upgraded from version 0 to {LATEST}" in logic("db", "upgrade", url=False)
    configured = subprocess.run([LOGIC, "login-link", "5"], cwd=logic.cwd, env=logic.env,
                                capture_output=True, text=True, timeout=60)
    assert configured.stdout.startswith("https://logic.example/login/")
    assert configured.stderr == ""
    bad = Logic("", tmp_path, env={"LOGIC_SERVER_HOTS": "x"})
    assert bad("db", "upgrade", url=False, code=2) == "logic: error: env: unknown variable LOGIC_SERVER_HOTS"
    config.write_text("[server]\nhots = 1\n")
    assert logic("db", "upgrade", url=False, code=2) == "logic: error: config: unknown key server.hots"


def test_upgrade_refuses_a_database_newer_than_the_release(tmp_path):
    # Review, session 27: it said "schema is current (version 99)" and exited 0,
    # so a start-up check (ExecStartPre) passed on a database this release
    # cannot serve.
    import sqlite3
    logic = Logic(f"sqlite:///{tmp_path}/new.db", tmp_path)
    logic("db", "upgrade")
    with sqlite3.connect(tmp_path / "new.db") as conn:
        conn.execute("INSERT INTO schema_version VALUES (99, 'future', '2030-01-01')")
    expected = (f"logic: error: database schema is at version 99, newer than this release "
                f"({LATEST}): upgrade the software")
    assert logic("db", "upgrade", code=1) == expected
    assert logic("script", "list", "1", code=1) == expected


def test_a_mistyped_sqlite_path_is_named_and_no_file_is_made(tmp_path):
    # Before, any command made an empty file at a mistyped path (and said the
    # schema was at version 0); only `db upgrade` and `demo` make a database.
    logic = Logic(f"sqlite:///{tmp_path}/typo.db", tmp_path)
    expected = (f'logic: error: cannot open database {tmp_path}/typo.db: no such file '
                '("logic db upgrade" makes a new database there)')
    assert logic("guild", "list", code=1) == expected
    assert logic("db", "version", code=1) == expected
    proc = subprocess.run([LOGIC, "--database-url", logic.url, "serve", "--port", "0"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**logic.env, "LOGIC_SERVER_COOKIE_SECRET": "c" * 40})
    assert proc.returncode == 1 and proc.stderr.strip() == expected
    assert not (tmp_path / "typo.db").exists()
    assert logic("db", "upgrade", "--json")["to"] == LATEST
    assert logic("guild", "list", "--json") == {"guilds": []}
    # Review, session 28: a path in a missing directory is named as such, and
    # a file: URI (which SQLite would read with modes of its own) is refused.
    nodir = Logic(f"sqlite:///{tmp_path}/nodir/x.db", tmp_path)
    assert nodir("guild", "list", code=1) == (
        f"logic: error: cannot open database {tmp_path}/nodir/x.db: no such directory "
        f"{tmp_path}/nodir")
    uri = Logic("sqlite:///file:typo3.db", tmp_path)
    assert "not a file: URI" in uri("guild", "list", code=2)
    assert not (tmp_path / "typo3.db").exists() and not (tmp_path / "nodir").exists()


def test_commands_refuse_a_partly_migrated_database(tmp_path):
    from models.db import connect, database
    from models.migrate import Runner
    url = f"sqlite:///{tmp_path}/old.db"
    db = connect(url)
    Runner(db).upgrade(2)
    db.close()
    database.initialize(None)
    logic = Logic(url, tmp_path)
    assert logic("script", "list", "1", "--json", code=1) == (
        f'logic: error: database schema is at version 2, this release needs {LATEST}: '
        'run "logic db upgrade"')
    assert logic("db", "upgrade", "--json") == {"applied": [v for v in VERSIONS if v > 2],
                                                "from": 2, "to": LATEST}
    assert logic("db", "version", "--json") == {"current": LATEST, "latest": LATEST}
    assert "secret regenerate" not in logic("--help") and "Commands:" in logic("--help")
    # A copy of a database keeps its installation id (rate limits in a shared
    # Redis named after it): the copy gets its own.
    import shutil
    copy = Logic(f"sqlite:///{tmp_path}/copy.db", tmp_path)
    shutil.copy(tmp_path / "old.db", tmp_path / "copy.db")
    db = connect(url)
    from models.installation import installation_id
    original = installation_id()
    db.close()
    renewed = copy("db", "new-installation-id", "--json")["installation"]
    assert len(renewed) == 16 and renewed != original
    db = connect(f"sqlite:///{tmp_path}/copy.db")
    assert installation_id() == renewed
    db.close()
    db = connect(url)
    assert installation_id() == original
    db.close()
    database.initialize(None)


def test_a_database_error_or_a_failed_write_is_one_line(tmp_path):
    # Review, session 25: "database is locked", or output to a full disk, gave
    # a 57-line traceback; after `secret regenerate` nothing said the secret
    # had changed though it was never shown.
    import sqlite3
    logic = Logic(f"sqlite:///{tmp_path}/l.db", tmp_path)
    logic("db", "upgrade")
    logic("guild", "create", "1", "--owner", "10")
    raw = sqlite3.connect(tmp_path / "l.db")
    raw.execute("DROP TABLE guild_manager")     # what a damaged database answers
    raw.commit()
    raw.close()
    line = logic("guild", "add-manager", "1", "20", "--as", "10", code=1)
    assert line == "logic: error: the database refused the command: no such table: guild_manager"
    proc = subprocess.run(f"{LOGIC} --database-url sqlite:///{tmp_path}/l.db db version "
                          "--json > /dev/full", shell=True, cwd=tmp_path, env=logic.env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "logic: error: could not write the output (No space left on device); the command may "
        "have completed: check with a read command"]
