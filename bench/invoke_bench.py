"""Throughput and latency of the invoke endpoint against a bare Tornado handler, in one run.

Both servers do the same work unit (bearer-token check, JSON parse of a ~300-byte
body, validation of two fields, JSON reply); Logic Endpoints adds everything it
really does: endpoint lookup, argon2 secret check (cached), rate limit, sandbox
worker round trip, history and statistics records. wrk (one thread) is pinned to
CPU 0 and the server under test to CPU 1 (workers included), as in
../shared/PERFORMANCE.md.

    python bench/invoke_bench.py [--duration 5] [--rounds 3] [--connections 4,16,64]
                                 [--no-journal] [--processes N]
                                 [--database postgresql://...]

`--no-journal` adds a third server in the same alternating rounds: logic serve
with `records.journal = "off"`, so the journal's cost is the ratio of the two
logic-endpoints runs (printed at the end). `--before DIR` does the same with
the `service` package of another tree (e.g. `git archive main service | tar
-x -C DIR`), imported first through PYTHONPATH: the cost of a branch's changes
to the service, measured in one run.

`--processes N` instead compares `logic serve` with 1 and with N front
processes in one run, nothing pinned (bench/process_scaling.py).

`--database URL` adds logic serve on PostgreSQL to the same alternating
rounds (the SQLite one stays): a fresh database is created on that server for
the run and dropped after it (a fresh schema in the URL's database where the
role may not create databases; other writers to that database then send
change notifications that empty the nodes' endpoint cache). The PostgreSQL
server itself runs unpinned, off the server's core. Printed at the end: the
PostgreSQL / SQLite ratio.

Prints, per connection count: requests/s, p50/p99 latency, the ratio to the bare
handler, and CPU time per request: all of the server's core (kernel network
work included), and of it the server process and the sandbox workers.
Needs `wrk` (Debian package `wrk`) and `taskset`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
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

CONFIG = """
[sandbox]
workers = {workers}
queue_timeout_ms = 5000

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


def _knows_env(tree: str) -> bool:
    """Whether the `service` package in `tree` accepts the cookie-secret variable
    (trees from before the dashboard refuse it as unknown)."""
    return "cookie_secret" in (Path(tree) / "service" / "settings.py").read_text()


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


def run_wrk(url: str, lua: str, connections: int, duration: int) -> dict[str, float]:
    out = subprocess.run(
        ["taskset", "-c", "0", "wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency",
         "-s", lua, url], check=True, capture_output=True, text=True).stdout
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=5, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per server")
    parser.add_argument("--connections", default="4,16,64")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-journal", action="store_true",
                        help="also run logic serve without the records journal")
    parser.add_argument("--before", default=None,
                        help="also run logic serve with the service package found in DIR")
    parser.add_argument("--processes", type=int, default=0,
                        help="compare 1 and N front processes instead (nothing pinned)")
    parser.add_argument("--database", default=None, metavar="URL",
                        help="also run logic serve on PostgreSQL (a fresh database on this server)")
    args = parser.parse_args()
    if args.database and not args.database.startswith(("postgresql://", "postgres://")):
        sys.exit("invoke_bench: --database takes a postgresql:// URL")
    conns = [int(c) for c in args.connections.split(",")]
    if not shutil.which("wrk"):
        sys.exit("invoke_bench: wrk is not installed (apt-get install wrk)")

    tmp = Path(tempfile.mkdtemp(prefix="logic-bench-"))
    db, cfg, script_id, secret, lua = bench_endpoint(tmp, args.workers)
    path = f"/endpoints/1000/{script_id}"
    if args.processes:
        from process_scaling import compare

        try:
            compare(args, LOGIC, db, cfg, lua, path, {**SERVE_ENV, **os.environ,
                                                      "PYTHONUNBUFFERED": "1"},
                    free_port, median_run)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return

    procs: list[subprocess.Popen[str]] = []
    base: dict[int, dict[str, float]] = {}
    ours: dict[int, dict[str, float]] = {}
    plain: dict[int, dict[str, float]] = {}
    on_pg: dict[int, dict[str, float]] = {}
    pg_paired: dict[int, float] = {}
    plain_paired: dict[int, float] = {}
    drop_pg: Callable[[], None] | None = None
    try:
        # Both servers run side by side on the same core, only one of them
        # loaded at a time: the runs alternate, so a shared machine that
        # speeds up or slows down during the bench affects both alike.
        bare_port = free_port()
        bare = subprocess.Popen(["taskset", "-c", str(SERVER_CPU), sys.executable,
                                 str(HERE / "bare_server.py"), str(bare_port), secret],
                                stdout=subprocess.PIPE, text=True)
        procs.append(bare)
        wait_listening(bare)
        port = free_port()
        env = {**SERVE_ENV, **os.environ, "PYTHONUNBUFFERED": "1"}
        svc = subprocess.Popen(["taskset", "-c", str(SERVER_CPU), LOGIC, "--database-url", db,
                                "--config", str(cfg), "serve", "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        procs.append(svc)
        wait_listening(svc)
        bare_url = f"http://127.0.0.1:{bare_port}{path}"
        our_url = f"http://127.0.0.1:{port}{path}"
        nojournal = None
        if args.no_journal or args.before:
            plain_port = free_port()
            # Its own journal: a journal belongs to one process (service.http.journal).
            other_env = ({**env, "PYTHONPATH": args.before,
                          "LOGIC_RECORDS_JOURNAL": str(tmp / "before-journal")} if args.before
                         else {**env, "LOGIC_RECORDS_JOURNAL": "off"})
            plain_db, plain_cfg, plain_path, plain_lua = db, cfg, path, lua
            if args.before and not _knows_env(args.before):
                # An older tree that knows neither the cookie secret nor the
                # journal's variable (and needs neither), and refuses a newer
                # schema: it gets its own database, made by its own CLI.
                other_env = {k: v for k, v in other_env.items()
                             if k not in SERVE_ENV and k != "LOGIC_RECORDS_JOURNAL"}
                (tmp / "before").mkdir()
                plain_db, plain_cfg, plain_id, _, plain_lua = bench_endpoint(
                    tmp / "before", args.workers, env=other_env)
                plain_path = f"/endpoints/1000/{plain_id}"
            nojournal = subprocess.Popen(
                ["taskset", "-c", str(SERVER_CPU), LOGIC, "--database-url", plain_db, "--config",
                 str(plain_cfg), "serve", "--port", str(plain_port)], stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, env=other_env)
            procs.append(nojournal)
            wait_listening(nojournal)
            plain_url = f"http://127.0.0.1:{plain_port}{plain_path}"
            run_wrk(plain_url, str(plain_lua), 4, 2)
        pg = None
        if args.database:
            pg_db, drop_pg = fresh_database(args.database)
            _, _, pg_script, _, pg_lua = bench_endpoint(tmp, args.workers, database=pg_db)
            pg_port = free_port()
            pg = subprocess.Popen(["taskset", "-c", str(SERVER_CPU), LOGIC, "--database-url",
                                   pg_db, "--config", str(cfg), "serve", "--port", str(pg_port)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**env, "LOGIC_RECORDS_JOURNAL": str(tmp / "pg-journal")})
            procs.append(pg)
            wait_listening(pg)
            pg_url = f"http://127.0.0.1:{pg_port}/endpoints/1000/{pg_script}"
            run_wrk(pg_url, str(pg_lua), 4, 2)
        run_wrk(bare_url, str(lua), 4, 2)  # warm up: caches, compiled script in every worker
        run_wrk(our_url, str(lua), 4, 2)
        print(f"bare: a Tornado handler doing the work in-process; logic-endpoints: logic serve, "
              f"{args.workers} workers, secret, rate limit, sandbox, history, statistics. "
              f"{args.rounds} alternating rounds of {args.duration}s", flush=True)
        for c in conns:
            runs_bare, runs_ours, runs_plain, runs_pg = [], [], [], []
            for r in range(args.rounds):
                runs_bare.append(measure("bare", bare.pid, bare_url, str(lua), c, args.duration))
                plan = [("logic-endpoints", svc.pid, our_url, str(lua), runs_ours)]
                if nojournal is not None:
                    # Which of the two goes first alternates between rounds: a
                    # machine that drifts within a round favours neither.
                    other = ("before" if args.before else "no journal", nojournal.pid,
                             plain_url, str(plain_lua), runs_plain)
                    plan = [plan[0], other] if r % 2 == 0 else [other, plan[0]]
                for name, pid, url, script, runs in plan:
                    runs.append(measure(name, pid, url, script, c, args.duration))
                if pg is not None:
                    runs_pg.append(measure("postgresql", pg.pid, pg_url, str(pg_lua), c,
                                           args.duration))
            base[c], ours[c] = median_run(runs_bare), median_run(runs_ours)
            if runs_plain:
                plain[c] = median_run(runs_plain)
                ratios = sorted(o["rps"] / p["rps"] for o, p in zip(runs_ours, runs_plain))
                plain_paired[c] = ratios[len(ratios) // 2]
            if runs_pg:
                on_pg[c] = median_run(runs_pg)
                # Each PostgreSQL run against the SQLite run just before it:
                # a shared machine's load changes less within a round.
                paired = sorted(p["rps"] / o["rps"] for p, o in zip(runs_pg, runs_ours))
                pg_paired[c] = paired[len(paired) // 2]
        svc.send_signal(signal.SIGTERM)
        svc.wait(60)
        if nojournal is not None:
            nojournal.send_signal(signal.SIGTERM)
            nojournal.wait(60)
        if pg is not None:
            pg.send_signal(signal.SIGTERM)
            pg.wait(60)
        bare.send_signal(signal.SIGTERM)
        bare.wait(10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if drop_pg is not None:
            drop_pg()
        shutil.rmtree(tmp, ignore_errors=True)

    print("\nmedian runs, ratio (logic-endpoints / bare):")
    for c in conns:
        print(f"  c={c:<3} throughput {ours[c]['rps'] / base[c]['rps']:6.1%}   "
              f"p50 {ours[c]['p50']:.2f} vs {base[c]['p50']:.2f} ms   "
              f"p99 {ours[c]['p99']:.2f} vs {base[c]['p99']:.2f} ms   "
              f"core/req {ours[c]['cpu_us']:.0f} vs {base[c]['cpu_us']:.0f} us")
    if plain:
        print("\nlogic-endpoints / " + ("before" if args.before else "no journal") + ":")
        for c in conns:
            print(f"  c={c:<3} throughput {ours[c]['rps'] / plain[c]['rps']:6.1%} "
                  f"(median of the rounds' ratios {plain_paired[c]:6.1%})   "
                  f"core/req {ours[c]['cpu_us']:.0f} vs {plain[c]['cpu_us']:.0f} us "
                  f"(server {ours[c]['parent_us']:.0f} vs {plain[c]['parent_us']:.0f})")
    if on_pg:
        print("\nlogic-endpoints on PostgreSQL / on SQLite:")
        for c in conns:
            print(f"  c={c:<3} throughput {on_pg[c]['rps'] / ours[c]['rps']:6.1%} "
                  f"(median of the rounds' ratios {pg_paired[c]:6.1%})   "
                  f"p99 {on_pg[c]['p99']:.2f} vs {ours[c]['p99']:.2f} ms   "
                  f"core/req {on_pg[c]['cpu_us']:.0f} vs {ours[c]['cpu_us']:.0f} us "
                  f"(server {on_pg[c]['parent_us']:.0f} vs {ours[c]['parent_us']:.0f})")


if __name__ == "__main__":
    main()
