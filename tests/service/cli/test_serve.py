"""`logic demo` and `logic serve` as a user runs them (real subprocesses)."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.service.http.harness import LOGIC


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(port: int, path: str, secret: str, body: object) -> tuple[int, object]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", path, body=json.dumps(body),
                 headers={"Authorization": f"Bearer {secret}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data)


def _run_demo(db: str, port: int) -> tuple[subprocess.Popen[str], str, str, str]:
    proc = subprocess.Popen([LOGIC, "--database-url", db, "demo", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "listening on" in line:
            break
    text = "".join(lines)
    url = re.search(r"Demo endpoint: (\S+)", text)
    secret = re.search(r"Secret \(shown once, keep it safe\): (lsk_\S+)", text)
    curl = re.search(r"curl .*", text)
    assert url and secret and curl, text
    assert secret.group(1) in curl.group(0) and url.group(1) in curl.group(0)
    return proc, url.group(1), secret.group(1), text


def _stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(30)
    assert proc.stdout is not None
    proc.stdout.close()
    return code


def test_demo_serves_a_working_endpoint_and_a_rerun_rotates_the_secret(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'demo.db'}"
    port = _free_port()
    proc, url, secret, _ = _run_demo(db, port)
    try:
        assert url.startswith(f"http://127.0.0.1:{port}/endpoints/")
        path = url.split(str(port), 1)[1]
        assert _post(port, path, secret, {"score": 21}) == (200, {"ok": True, "double": 42})
        assert _post(port, path, secret, {"score": "x"}) == (422, {"error": "score must be an integer"})
    finally:
        assert _stop(proc) == 0

    proc, url2, secret2, _ = _run_demo(db, port)
    try:
        assert url2 == url and secret2 != secret  # same guild and script, a new secret
        path = url.split(str(port), 1)[1]
        status, body = _post(port, path, secret, {"score": 1})
        assert status == 401 and body["error"]["code"] == "unauthorized"  # type: ignore[index]
        assert _post(port, path, secret2, {"score": 1}) == (200, {"ok": True, "double": 2})
    finally:
        assert _stop(proc) == 0


def test_a_second_demo_changes_nothing_and_says_why(tmp_path: Path) -> None:
    # Review, session 27: a second `logic demo` made a new secret (the first
    # one's printed curl line then got 401) and only then failed, saying
    # "could not write the output".
    db = f"sqlite:///{tmp_path / 'demo.db'}"
    port = _free_port()
    proc, url, secret, _ = _run_demo(db, port)
    try:
        second = subprocess.run([LOGIC, "--database-url", db, "demo", "--port", str(port)],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and second.stdout == ""
        assert second.stderr == (f"logic: error: cannot serve on 127.0.0.1:{port}: "
                                 "Address already in use\n")
        path = url.split(str(port), 1)[1]
        assert _post(port, path, secret, {"score": 2}) == (200, {"ok": True, "double": 4})
        other = subprocess.run([LOGIC, "--database-url", db, "demo", "--port",
                                str(_free_port())], capture_output=True, text=True, timeout=60)
        assert other.returncode == 1 and other.stdout == ""
        assert "records journal" in other.stderr and "used by another process" in other.stderr
        assert "cannot serve on" not in other.stderr
        assert _post(port, path, secret, {"score": 3}) == (200, {"ok": True, "double": 6})
    finally:
        assert _stop(proc) == 0


def test_serve_refuses_a_database_that_is_behind(tmp_path: Path) -> None:
    (tmp_path / "new.db").touch()     # an empty database: schema version 0
    proc = subprocess.run([LOGIC, "--database-url", f"sqlite:///{tmp_path / 'new.db'}", "serve",
                           "--port", str(_free_port())], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "logic db upgrade" in proc.stderr


def test_serve_refuses_a_bad_setting_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[server]\nhots = 1\n")
    proc = subprocess.run([LOGIC, "--config", str(config), "serve"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == "logic: error: config: unknown key server.hots\n"


def test_serve_reports_a_port_in_use(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'x.db'}"
    subprocess.run([LOGIC, "--database-url", db, "db", "upgrade"], check=True, capture_output=True)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([LOGIC, "--database-url", db, "serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    # One line, naming the address, before any worker was started.
    assert proc.stderr == f"logic: error: cannot serve on 127.0.0.1:{port}: Address already in use\n"


def test_serve_with_front_processes_refuses_a_port_another_installation_shares(
        tmp_path: Path) -> None:
    # Review, session 27: the fronts bind with SO_REUSEPORT, so a second
    # installation started on a port in use (its listeners shareable as the
    # fronts' are) took half of the first one's requests, logging "ready".
    db = f"sqlite:///{tmp_path / 'x.db'}"
    subprocess.run([LOGIC, "--database-url", db, "db", "upgrade"], check=True, capture_output=True)
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([LOGIC, "--database-url", db, "serve", "--port", str(port),
                               "--processes", "2"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr == f"logic: error: cannot serve on 127.0.0.1:{port}: Address already in use\n"


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_journal_that_cannot_be_used_is_named(tmp_path: Path, processes: str) -> None:
    db = f"sqlite:///{tmp_path / 'x.db'}"
    subprocess.run([LOGIC, "--database-url", db, "db", "upgrade"], check=True, capture_output=True)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    proc = subprocess.run([LOGIC, "--database-url", db, "serve", "--port", str(_free_port()),
                           "--processes", processes], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LOGIC_RECORDS_JOURNAL": str(a_file)})
    assert proc.returncode == 2
    assert proc.stderr == (f"logic: error: records.journal: cannot use {a_file} as the records "
                           "journal: File exists\n")


def test_a_database_that_cannot_be_opened_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "x.db"
    proc = subprocess.run([LOGIC, "--database-url", f"sqlite:///{missing}", "script", "list", "1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"logic: error: cannot open database {missing}: ")
    pg = subprocess.run([LOGIC, "--database-url", "postgresql://u:hunter2@127.0.0.1:1/nodb",
                         "script", "list", "1"], capture_output=True, text=True, timeout=60)
    assert pg.returncode == 1 and "postgresql://u@127.0.0.1:1/nodb" in pg.stderr
    assert "hunter2" not in pg.stderr


@pytest.mark.parametrize("args, shown", [
    (["serve", "--port", "٨٠٨٠"], "'--port': '٨٠٨٠' is not a whole number in ASCII digits (0-9)"),
    (["serve", "--port", "80_80"], "'--port': '80_80' is not a whole number in ASCII digits"),
    (["serve", "--port", "70000"], "'--port': 70000 is above the most allowed, 65535"),
    (["serve", "--workers", "0"], "'--workers': 0 is below the least allowed, 1"),
    (["demo", "--port", " 8080"], "'--port': ' 8080' is not a whole number in ASCII digits"),
    (["history", "1", "2", "--limit", "２"], "'--limit': '２' is not a whole number"),
    (["guild", "audit", "1", "--limit", "5000"], "'--limit': 5000 is above the most allowed, 1000"),
    (["script", "rollback", "1", "2", "+1"], "'VERSION': '+1' is not a whole number"),
])
def test_numbers_are_ascii_digits_within_their_range(tmp_path: Path, args: list[str],
                                                      shown: str) -> None:
    """What `int()` would read from other scripts' digits, underscores, signs or
    spaces is refused before anything starts or opens the database."""
    db = tmp_path / "never.db"
    proc = subprocess.run([LOGIC, "--database-url", f"sqlite:///{db}", *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("logic: error: Invalid value for ") and shown in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stdout == ""
    assert not db.exists()


@pytest.mark.parametrize("args, shown", [
    (["serve", "--help"], "Port, 0-65535"),
    (["serve", "--help"], "Sandbox worker processes, 1 or more"),
    (["history", "list", "--help"], "Show at most N records, 1-1000."),
    (["guild", "audit", "--help"], "Show at most N entries, 1-1000."),
])
def test_help_states_each_numbers_range(args: list[str], shown: str) -> None:
    """The ranges the checks above enforce are in the help, before anyone hits them."""
    proc = subprocess.run([LOGIC, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert shown in " ".join(proc.stdout.split())


def test_a_reload_refuses_what_serve_refuses_at_start(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Review, session 27: SIGHUP applied a configuration without the cookie
    # secret (sessions signed with an empty key) or with a database of no
    # schema (every invoke 500 while /readyz said ready). The reload now
    # raises what `serve` would say, and the arbiter keeps its fronts (as for
    # any configuration error: tests/service/http/test_processes.py).
    from service.cli.base import State
    from service.cli.serve import _reloader
    from service.settings import SettingsError
    good = tmp_path / "good.db"
    subprocess.run([LOGIC, "--database-url", f"sqlite:///{good}", "db", "upgrade"], check=True,
                   capture_output=True)
    config = tmp_path / "logic.toml"
    config.write_text(f'[database]\nurl = "sqlite:///{good}"\n')
    reload = _reloader(State(config=str(config)))
    assert reload().database.url == f"sqlite:///{good}"
    (tmp_path / "empty.db").touch()
    config.write_text(f'[database]\nurl = "sqlite:///{tmp_path / "empty.db"}"\n')
    with pytest.raises(SettingsError, match=r"database schema is at version 0, this release "):
        reload()
    config.write_text('[database]\nurl = "postgresql://nobody@127.0.0.1:1/none"\n')
    with pytest.raises(SettingsError, match=r"^cannot open database "):
        reload()
    config.write_text(f'[database]\nurl = "sqlite:///{tmp_path / "typo.db"}"\n')
    with pytest.raises(SettingsError, match=r": no such file \("):
        reload()
    assert not (tmp_path / "typo.db").exists()
    config.write_text(f'[database]\nurl = "sqlite:///{good}"\n')
    monkeypatch.delenv("LOGIC_SERVER_COOKIE_SECRET")
    with pytest.raises(SettingsError, match="server.cookie_secret is not set"):
        reload()


def _serve_until_ready(url: str, port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([LOGIC, "--database-url", url, "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "LOGIC_SERVER_COOKIE_SECRET": "c" * 40})
    deadline = time.monotonic() + 30
    while True:
        try:
            if _get(port, "/readyz")[0] == 200:
                return proc
        except OSError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)


def _get(port: int, path: str) -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    return resp.status, body


def test_a_database_file_replaced_while_serving_is_neither_written_nor_corrupted(
        tmp_path: Path) -> None:
    # Review, session 28: with a copy moved over the file in use, new
    # connections opened the copy with the old file's WAL (found by name) and
    # the copy came out corrupted ("2nd reference to page 45"); /readyz said
    # ready. Now no connection opens the new file, the records wait in the
    # journal, the node is not ready, and the copy stays intact.
    import sqlite3
    db = tmp_path / "live.db"
    url = f"sqlite:///{db}"
    logic = [LOGIC, "--database-url", url]
    env = {**os.environ, "LOGIC_SERVER_COOKIE_SECRET": "c" * 40}
    for args in (["db", "upgrade"], ["guild", "create", "1", "--owner", "10", "--plan", "pro"]):
        subprocess.run(logic + args, check=True, capture_output=True, env=env)
    (tmp_path / "s.py").write_text("on endpoint(event):\n    event.reply({'ok': True})\n")
    sid = json.loads(subprocess.run(logic + ["script", "create", "1", "--name", "s", "--file",
                                             str(tmp_path / "s.py"), "--json"], check=True,
                                    capture_output=True, text=True, env=env).stdout)
    sid = sid["logicScriptId"]
    subprocess.run(logic + ["endpoint", "enable", "1", sid, "--as", "10"], check=True,
                   capture_output=True, env=env)
    secret = json.loads(subprocess.run(logic + ["secret", "regenerate", "1", sid, "--as", "10",
                                                "--json"], check=True, capture_output=True,
                                       text=True, env=env).stdout)["secret"]
    token = json.loads(subprocess.run(logic + ["token", "create", "--user", "10", "--json"],
                                      check=True, capture_output=True, text=True,
                                      env=env).stdout)["token"]
    port = _free_port()
    path = f"/endpoints/1/{sid}"
    proc = _serve_until_ready(url, port)
    try:
        for n in range(3):
            assert _post(port, path, secret, {"n": n}) == (200, {"ok": True})
        for _ in range(4):      # the admin API's threads open their connections now
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/api/v1/guilds/1/scripts",
                         headers={"Authorization": f"Bearer {token}"})
            assert conn.getresponse().status == 200
            conn.close()
        time.sleep(1)                                 # written (the writer's 0.25 s)
        copy = tmp_path / "copy.db"
        with sqlite3.connect(db) as live, sqlite3.connect(copy) as backup:
            live.backup(backup)                       # a consistent copy...
        os.replace(copy, db)                          # ...moved over the file in use
        assert _get(port, "/readyz")[0] == 503
        for n in range(20):                           # remembered endpoint: still answered
            assert _post(port, path, secret, {"n": n})[0] == 200
        # Second review, session 28: a write through a connection opened
        # before (the admin API's thread) went on into the old file's WAL.
        for n in range(3):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("POST", "/api/v1/guilds/1/scripts",
                         body=json.dumps({"name": f"new{n}", "source": "x = 1\n"}),
                         headers={"Authorization": f"Bearer {token}",
                                  "Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 503 and json.loads(resp.read())["error"]["code"] == "busy"
            conn.close()
        time.sleep(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    with sqlite3.connect(db) as check:
        assert check.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert check.execute("SELECT COUNT(*) FROM request_record").fetchone() == (3,)
        assert check.execute("SELECT COUNT(*) FROM script").fetchone() == (1,)
    lines = [line for line in err.splitlines() if "was removed or replaced" in line]
    assert any("ERROR" in line for line in lines), err
    assert any("writing records to the database fails" in line for line in lines), err
    # The next start replays the 20 answered meanwhile from the journal.
    proc = _serve_until_ready(url, port)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    with sqlite3.connect(db) as check:
        assert check.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert check.execute("SELECT COUNT(*) FROM request_record").fetchone() == (23,)


def test_a_database_file_removed_while_serving_makes_the_node_not_ready(tmp_path: Path) -> None:
    # Before, /readyz said ready; a connection opened after the removal made
    # a new empty database.
    db = tmp_path / "live.db"
    url = f"sqlite:///{db}"
    subprocess.run([LOGIC, "--database-url", url, "db", "upgrade"], check=True,
                   capture_output=True)
    port = _free_port()
    proc = _serve_until_ready(url, port)
    try:
        aside = tmp_path / "aside.db"
        os.replace(db, aside)
        status, body = _get(port, "/readyz")
        assert status == 503 and body["dependencies"]["database"] == {"state": "down"}
        assert not db.exists()            # no new empty file either
        os.replace(aside, db)             # put back: the same file, ready again
        assert _get(port, "/readyz")[0] == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert sum("was removed or replaced" in line and "ERROR" in line
               for line in err.splitlines()) == 1, err
    assert "is the one the service opened again: ready" in err


def test_sighup_to_a_single_process_is_logged_and_ignored(tmp_path: Path) -> None:
    # Before, SIGHUP (`systemctl reload`) ended a one-process service at once:
    # requests in flight cut, no drain.
    url = f"sqlite:///{tmp_path / 'one.db'}"
    subprocess.run([LOGIC, "--database-url", url, "db", "upgrade"], check=True,
                   capture_output=True)
    port = _free_port()
    proc = subprocess.Popen([LOGIC, "--database-url", url, "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "LOGIC_SERVER_COOKIE_SECRET": "c" * 40})

    def healthy() -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/healthz")
            ok = conn.getresponse().status == 200
            conn.close()
            return ok
        except OSError:
            return False

    try:
        deadline = time.monotonic() + 30
        while not healthy():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert proc.poll() is None and healthy()
        # Review, session 28: SIG_IGN set for this leaked into the sandbox's
        # processes (the fork server, its workers, the compile server).
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert children
        for child in children:
            status = Path(f"/proc/{child}/status").read_text()
            ignored = int(re.search(r"SigIgn:\s*([0-9a-f]+)", status).group(1), 16)
            assert not ignored & 1 << (signal.SIGHUP - 1), status
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert err.count("SIGHUP ignored: a reload needs server.processes above 1") == 1, err
