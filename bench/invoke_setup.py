"""What the invoke benches share: the bench endpoint, `logic serve`, wrk runs and CPU counts.

`bench_endpoint` makes a SQLite (or a given, empty) database with guild 1000
on a bench plan, the echo-validate script's endpoint enabled, and a wrk Lua
file posting to it; `measure` runs wrk against a server and reads the
server's CPU (process, workers, the whole core) around the run. Used by
invoke_bench.py, scale_bench.py, api_bench.py, fairness_bench.py and
http_fixes_cost.py.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import psutil

HERE = Path(__file__).resolve().parent
SERVER_CPU = 1  # the server under test runs here; wrk on CPU 0
LOGIC = str(Path(sys.executable).parent / "logic")

SCRIPT = """
on endpoint(event):
    body = event.body
    if not isinstance(body, dict) or not isinstance(body.get("score"), int) \\
            or not isinstance(body.get("player"), str):
        event.status(422)
        event.reply({"error": "score must be an integer"})
        return
    event.reply({"ok": True, "double": body["score"] * 2})
"""

#: The bench plan: limits that never refuse the load (the rate limit is still checked).
BENCH_PLAN = """
[plans.bench]
endpoints = 9
memory_kb = 4096
requests_per_minute = 100000000
body_bytes = 1048576
history = 200
error_logs = true
ip_whitelist = true
advanced_stats = true
time_limit_ms = 1000
"""

CONFIG = """
[sandbox]
workers = {workers}
queue_timeout_ms = 5000
""" + BENCH_PLAN.replace("{", "{{").replace("}", "}}")

BODY = json.dumps({"player": "bench-player", "score": 21, "note": "x" * 250})

WRK_LUA = """
wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {secret}"
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def logic(db: str, cfg: str, *args: str, env: dict[str, str] | None = None) -> dict[str, object]:
    out = subprocess.run([LOGIC, "--database-url", db, "--config", cfg, *args, "--json"],
                         check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out) if out.strip() else {}


def tree_env(tree: str, env: dict[str, str], journal: Path) -> dict[str, str]:
    """`env` for `logic serve` with the packages of another `tree` imported first
    (PYTHONPATH), its records journal in `journal`, and without the variables
    that tree does not know: older trees refuse an unknown `LOGIC_<SECTION>_*`
    (the cookie secret came with the dashboard, the journal's variable with
    the journal)."""
    settings = (Path(tree) / "service" / "settings.py").read_text()
    out = {**env, "PYTHONPATH": tree, "LOGIC_RECORDS_JOURNAL": str(journal)}
    if "cookie_secret" not in settings:
        out = {k: v for k, v in out.items() if k not in SERVE_ENV}
    if "journal" not in settings:
        del out["LOGIC_RECORDS_JOURNAL"]
    return out


def wait_listening(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        if "listening on" in line:
            return
        seen.append(line)
    raise RuntimeError("server did not start:\n" + "".join(seen[-5:]))


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(server process with its threads, sandbox workers) CPU seconds so far.

    Workers are recycled under load (every ~10,000 jobs): a worker that ended
    was reaped by the fork server, whose children_* times hold its CPU.
    """
    parent = workers = 0.0
    proc = psutil.Process(pid)
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        if p.pid == pid:
            parent += t.user + t.system
        else:
            workers += t.user + t.system + t.children_user + t.children_system
    return parent, workers


def core_seconds(cpu: int) -> float:
    """Busy seconds of one CPU so far (/proc/stat): everything that ran on the
    server's core, the kernel's loopback TCP work included."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith(f"cpu{cpu} "):
                ticks = [int(x) for x in line.split()[1:]]
                idle = ticks[3] + ticks[4]
                return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    return 0.0


def cpu_split(server_pid: int) -> dict[tuple[str, int], float]:
    """Seconds on a CPU so far of every task of the server and its descendants, keyed by
    (part, task id): part is the server's main thread, its other threads, or the rest
    (which also holds, under minus the pid, what each descendant's reaped children
    used: subtract sums of parts, not task by task, so a worker that exits in
    between is counted)."""
    parents: dict[int, int] = {}
    reaped: dict[int, float] = {}   # CPU of a process's children it has waited for
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            parents[int(entry)] = int(fields[1])
            reaped[int(entry)] = (int(fields[13]) + int(fields[14])) / tick
    family = {server_pid}
    grew = True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in family and pid not in family:
                family.add(pid)
                grew = True
    out: dict[tuple[str, int], float] = {}
    for pid in family:
        if pid != server_pid:
            # Workers are recycled under load: one that exited was reaped by
            # the fork server, whose children's times (clock ticks) now hold it.
            out[("workers", -pid)] = reaped.get(pid, 0.0)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            part = ("workers" if pid != server_pid else "loop" if int(tid) == pid
                    else "threads")
            out[(part, int(tid))] = ns / 1e9
    return out


def _wrk_command(url: str, lua: str, connections: int, duration: int,
                 lua_args: tuple[str, ...] = ()) -> list[str]:
    return ["taskset", "-c", "0", "wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency",
            "-s", lua, url, *(("--", *lua_args) if lua_args else ())]


def _wrk_result(out: str) -> dict[str, float]:
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)

    def pct(name: str) -> float:
        m = re.search(rf"\s{name}%\s+([\d.]+)(us|ms|s)", out)
        assert m, out
        scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}[m.group(2)]
        return float(m.group(1)) * scale

    return {"rps": rps, "total": total, "p50": pct("50"), "p99": pct("99"),
            "errors": int(non2xx.group(1)) if non2xx else 0}


def run_wrk(url: str, lua: str, connections: int, duration: int,
            lua_args: tuple[str, ...] = ()) -> dict[str, float]:
    """One wrk run; `lua_args` reach the Lua script's ``init(args)``."""
    out = subprocess.run(_wrk_command(url, lua, connections, duration, lua_args), check=True,
                         capture_output=True, text=True).stdout
    return _wrk_result(out)


def run_wrk_together(targets: list[tuple[str, str]], connections: int,
                     duration: int) -> list[dict[str, float]]:
    """One wrk per (url, Lua script), all at once: servers sharing a core are
    loaded at the same time, so a host that speeds up or slows down during the
    run affects each alike (their throughputs' ratio is what is compared)."""
    procs = [subprocess.Popen(_wrk_command(url, lua, connections, duration),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for url, lua in targets]
    outs = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
        outs.append(_wrk_result(out))
    return outs


def measure(name: str, pid: int, url: str, lua: str, c: int, duration: int) -> dict[str, float]:
    """One wrk run at `c` connections, with the CPU it cost per request."""
    before, core_before = cpu_seconds(pid), core_seconds(SERVER_CPU)
    r = run_wrk(url, lua, c, duration)
    after, core_after = cpu_seconds(pid), core_seconds(SERVER_CPU)
    n = max(1, r["total"])
    r["parent_us"] = (after[0] - before[0]) / n * 1e6
    r["workers_us"] = (after[1] - before[1]) / n * 1e6
    r["cpu_us"] = (core_after - core_before) / n * 1e6
    print(f"  {name:<16} c={c:<3} {r['rps']:>8.0f} req/s  p50 {r['p50']:6.2f} ms  "
          f"p99 {r['p99']:6.2f} ms  core/req {r['cpu_us']:4.0f} us (server "
          f"{r['parent_us']:.0f}, workers {r['workers_us']:.0f})  non-2xx {r['errors']:.0f}",
          flush=True)
    return r


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the median throughput (its latencies and CPU come with it)."""
    return sorted(runs, key=lambda r: r["rps"])[len(runs) // 2]


#: `logic serve` refuses to start without a cookie secret (it signs dashboard sessions).
SERVE_ENV = {"LOGIC_SERVER_COOKIE_SECRET": "bench-cookie-secret-" + "x" * 32}


def bench_endpoint(tmp: Path, workers: int, database: str | None = None,
                   env: dict[str, str] | None = None) -> tuple[str, Path, str, str, Path]:
    """A SQLite database in `tmp` (or the empty `database`) with guild 1000 on
    the bench plan, the echo-validate script's endpoint enabled, and a wrk
    script posting to it: (database URL, config file, script id, secret, wrk Lua file)."""
    db = database or f"sqlite:///{tmp / 'bench.db'}"
    cfg = tmp / "bench.toml"
    cfg.write_text(CONFIG.format(workers=workers))
    (tmp / "script.py").write_text(SCRIPT)
    logic(db, str(cfg), "db", "upgrade", env=env)
    logic(db, str(cfg), "guild", "create", "1000", "--owner", "42", "--plan", "bench", env=env)
    script_id = str(logic(db, str(cfg), "script", "create", "1000", "--name", "bench",
                          "--file", str(tmp / "script.py"), env=env)["logicScriptId"])
    logic(db, str(cfg), "endpoint", "enable", "1000", script_id, env=env)
    secret = str(logic(db, str(cfg), "secret", "regenerate", "1000", script_id, "--as", "42",
                       env=env)["secret"])
    lua = tmp / ("post.lua" if database is None else "post-database.lua")
    lua.write_text(WRK_LUA.format(body=json.dumps(BODY), secret=secret))
    return db, cfg, script_id, secret, lua


def fresh_database(url: str) -> tuple[str, Callable[[], None]]:
    """An empty database on the PostgreSQL server of `url` (else a fresh schema
    in its database): (its URL, a function that drops it)."""
    import psycopg2  # type: ignore[import-untyped,unused-ignore]
    from psycopg2 import sql  # type: ignore[import-untyped,unused-ignore]

    name = f"logic_bench_{uuid.uuid4().hex[:10]}"
    parts = urlsplit(url)
    try:
        admin = psycopg2.connect(url, connect_timeout=5)
    except psycopg2.OperationalError as err:  # the message names host and port, not the password
        sys.exit(f"invoke_bench: --database: {str(err).strip().splitlines()[0]}")
    admin.autocommit = True
    try:
        with admin.cursor() as cur:
            cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        own = urlunsplit(parts._replace(path=f"/{name}"))

        def drop() -> None:
            with admin.cursor() as cur:
                cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
                            .format(sql.Identifier(name)))
            admin.close()
    except psycopg2.errors.InsufficientPrivilege:
        print(f"(no CREATEDB: using schema {name} in the URL's database)", flush=True)
        with admin.cursor() as cur:
            cur.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
        query = "&".join(filter(None, [parts.query,
                                       "options=" + quote(f"-c search_path={name}")]))
        own = urlunsplit(parts._replace(query=query))

        def drop() -> None:
            with admin.cursor() as cur:
                cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))
            admin.close()
    return own, drop
