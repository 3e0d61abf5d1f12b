"""Start-up: `logic serve` refuses to run without a cookie secret; `logic demo`
makes one and prints a working one-time login link for the demo owner."""
from __future__ import annotations

import http.client
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from tests.service.dashboard.conftest import free_port
from tests.service.http.harness import LOGIC


def test_serve_refuses_a_missing_or_short_cookie_secret(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'x.db'}"
    subprocess.run([LOGIC, "--database-url", db, "db", "upgrade"], check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k != "LOGIC_SERVER_COOKIE_SECRET"}
    proc = subprocess.run([LOGIC, "--database-url", db, "serve", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("logic: error: server.cookie_secret is not set")
    assert proc.stderr.count("\n") == 1
    short = "tooshort-secret"
    proc = subprocess.run([LOGIC, "--database-url", db, "serve"], capture_output=True, text=True,
                          timeout=60, env={**env, "LOGIC_SERVER_COOKIE_SECRET": short})
    assert proc.returncode == 2
    assert proc.stderr == ("logic: error: env: bad value for LOGIC_SERVER_COOKIE_SECRET: "
                           "too short: use at least 32 random characters\n")
    assert short not in proc.stderr


def test_demo_prints_a_login_link_that_opens_the_dashboard(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "LOGIC_SERVER_COOKIE_SECRET"}
    proc = subprocess.Popen([LOGIC, "--database-url", f"sqlite:///{tmp_path / 'demo.db'}", "demo",
                             "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**env, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "listening on" in line or not line:
                break
        text = "".join(lines)
        curl = text.index("curl ")
        match = re.search(r"Dashboard \(one-time login link for the demo owner\): "
                          rf"(http://127\.0\.0\.1:{port}(/login/\S+))", text)
        assert match and match.start() > curl, text
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", match.group(2))
        resp = conn.getresponse()
        resp.read()
        cookie = resp.getheader("Set-Cookie") or ""
        assert resp.status == 303 and resp.getheader("Location") == "/dashboard"
        conn.request("GET", "/dashboard/100000000000000001",
                     headers={"Cookie": cookie.split(";", 1)[0]})
        page = conn.getresponse()
        assert page.status == 200 and b"demo-score" in page.read()
        conn.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        proc.stdout.close()


def test_every_template_and_static_file_is_package_data() -> None:
    import configparser
    import fnmatch

    root = Path(__file__).resolve().parents[3]
    config = configparser.ConfigParser()
    config.read(root / "setup.cfg")
    globs = [g.strip() for g in config["options.package_data"]["service.dashboard"].split(",")]
    package = root / "service" / "dashboard"
    files = [p.relative_to(package).as_posix() for sub in ("templates", "static")
             for p in (package / sub).iterdir()]
    assert files and all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files), (files, globs)
