"""Flat cost from one active script to ten thousand: the scale table in one run.

Fills one SQLite database with 100,000 enabled endpoints, every script's source
distinct (bulk inserts straight into the tables `logic db upgrade` made), all
sharing one secret (stored as its SHA-256 verifier, as `secret regenerate`
stores it): guilds 1..100 hold 100 scripts each (10,000 scripts), guilds
100001.. one script each (90,000). Then `logic serve --workers 2` pinned to
CPU 1, wrk (one thread, 16 connections) pinned to CPU 0 POSTing the
echo-validate body, rotating over the row's endpoints:

    1 endpoint                      (the baseline)
    100 scripts over 100 guilds     round robin
    1,000 scripts over 100 guilds   round robin
    10,000 scripts over 100 guilds  round robin
    1,000 guilds                    round robin (one script each)
    10,000 guilds                   Zipf(1.1) popularity (one script each)

The rows and the wrk runs that walk them are in `scale_rows.py`.

Warm-up per row: every endpoint of the row called at least once (2 s wrk runs
rotating over them until as many requests were answered), then `--warmup`
seconds of the row's load; then `--duration` seconds measured. Each wrk run
goes on along its list where the run before it on that list stopped (a Lua
`init` argument; the requests still in flight when a run ended, at most
`--connections`, are sent again), so the warm-up reaches every endpoint and a
measured run calls what comes next in the row's sequence, not again the part
the row's warm-up load just called. Prints req/s, p50/p99 and the ratio to
the 1-endpoint row.

`--paired K`: on a host whose speed drifts by 10-15 % within minutes, a
row measured minutes after the 1-endpoint row compares two different
machines. With K > 0 every row after its warm-up is measured K times, each
time right after `--duration` seconds of the 1-endpoint load (whose worker
stays warm throughout), and prints each pair's ratio and their median.

Cold start: the server is stopped and started again (same database), and at
once the load of the row "1,000 scripts / 100 guilds" starts (`--cold-connections`
keep-alive connections, 16, from a client on CPU 0, 15 s): prints how many
were not answered 200 and the p99 per 0.5 s window, and from when on it stays
under 50 ms. (Latency under a burst is queueing: 1,000 requests in flight at
once on a server answering ~2,000/s wait ~0.5 s whatever the service does,
and past 256 per run slot they are answered 503 `busy` by design.)

    python bench/scale_bench.py [--duration 10] [--warmup 5] [--workers 2]
                                [--max-workers N] [--skip-fill DIR] [--no-cold-start]
                                [--rows 1,2,3] [--paired K] [--cpu]

`--cpu`: after each measured run, the server's CPU per request split three
ways: its event-loop (main) thread, its other threads (the records writer,
lookups, hashing) and its descendants (fork server and workers), from each
task's exact run time (`/proc/PID/task/TID/schedstat`); a worker that exited
during the run (recycled after its jobs, or retired for another guild) is
counted through the fork server's reaped children's times (clock ticks).

`PYTHONPATH=DIR python bench/scale_bench.py ...` runs the servers on the
`service`, `sandbox` and `models` packages found in DIR (another tree, for a
before/after comparison: `git archive REV service sandbox models | tar -x -C
DIR` plus the built `_memguard` module). Needs `wrk` and `taskset`. The figures depend on the machine's load: say so
when recording them.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from invoke_setup import (BODY, LOGIC, SCRIPT, SERVE_ENV, cpu_split,  # noqa: E402
                          free_port, logic, wait_listening)
from scale_rows import (BIG_GUILDS, SCRIPTS_PER_BIG, SECRET, SMALL_FIRST,  # noqa: E402
                        SMALL_GUILDS, Rotation, big_path, rows, script_id)

CONFIG = """
[sandbox]
workers = {workers}
queue_timeout_ms = 5000
max_workers = {max_workers}

[plans.scale]
endpoints = 1000
memory_kb = 4096
requests_per_minute = 100000000
body_bytes = 1048576
history = 0
error_logs = true
ip_whitelist = true
advanced_stats = false
time_limit_ms = 1000
"""

def source(n: int) -> str:
    """The echo-validate script, made distinct by a constant."""
    return SCRIPT.replace('"ok": True', f'"ok": True, "n": {n}')


def stored_secret() -> str:
    """What the tree under test stores for SECRET under the servers' cookie secret: its
    keyed verifier with the argon2id hash (made once, shared by every endpoint), or
    the SHA-256 digest of trees from before keyed verifiers."""
    from service.core import secrets
    if hasattr(secrets, "configure"):
        secrets.configure(SERVE_ENV["LOGIC_SERVER_COOKIE_SECRET"])
        return str(secrets.hash_secret(SECRET))
    return "sha256$" + hashlib.sha256(SECRET.encode()).hexdigest()


def fill(db_path: Path, cfg: Path) -> None:
    """The schema through `logic db upgrade`, then 100,000 endpoints by bulk insert."""
    url = f"sqlite:///{db_path}"
    logic(url, str(cfg), "db", "upgrade")
    verifier = stored_secret()
    now = "2026-01-01 00:00:00"
    con = sqlite3.connect(db_path)
    t0 = time.perf_counter()
    guilds = [(str(g), "42", "scale", now) for g in range(1, BIG_GUILDS + 1)]
    guilds += [(str(g), "42", "scale", now) for g in range(SMALL_FIRST, SMALL_FIRST + SMALL_GUILDS)]
    con.executemany("INSERT INTO guild (id, owner_id, plan, created_at) VALUES (?, ?, ?, ?)",
                    guilds)
    scripts = []
    n = 0
    for g in range(1, BIG_GUILDS + 1):
        for _ in range(SCRIPTS_PER_BIG):
            n += 1
            scripts.append((n, script_id(n), str(g), f"s{n}", source(n), 1, now, now))
    for g in range(SMALL_FIRST, SMALL_FIRST + SMALL_GUILDS):
        n += 1
        scripts.append((n, script_id(n), str(g), f"s{n}", source(n), 1, now, now))
    con.executemany("INSERT INTO script (id, public_id, guild_id, name, source, version, "
                    "created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", scripts)
    con.executemany("INSERT INTO script_version (script_id, version, source, author, created_at) "
                    "VALUES (?, 1, ?, 'operator', ?)", [(s[0], s[4], now) for s in scripts])
    con.executemany("INSERT INTO endpoint (script_id, enabled, enabled_at, secret_hash, "
                    "secret_hint, secret_created_at, whitelist, created_at) "
                    "VALUES (?, 1, ?, ?, 'ssss', ?, '[]', ?)",
                    [(s[0], now, verifier, now, now) for s in scripts])
    con.commit()
    con.close()
    print(f"filled {len(scripts):,} endpoints in {len(guilds):,} guilds in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)


def serve(db: str, cfg: Path, port: int, workers: int) -> subprocess.Popen[str]:
    env = {**SERVE_ENV, "PYTHONUNBUFFERED": "1", "PATH": "/usr/bin:/bin"}
    if os.environ.get("PYTHONPATH"):  # PYTHONPATH=DIR: the server runs the tree in DIR
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    proc = subprocess.Popen(["taskset", "-c", "1", LOGIC, "--database-url", db, "--config",
                             str(cfg), "serve", "--port", str(port), "--workers", str(workers)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    wait_listening(proc)
    assert proc.stdout is not None
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
    return proc


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cold_start(db: str, cfg: Path, port: int, workers: int, connections: int,
               seconds: float = 15.0) -> None:
    """Restart, then at once the row "1,000 scripts / 100 guilds" from `connections`
    keep-alive connections; p99 per 0.5 s window until it stays under 50 ms."""
    import http.client
    import os
    paths = [big_path(g, k) for k in range(10) for g in range(1, 101)]
    body = BODY.encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {SECRET}"}
    os.sched_setaffinity(0, {0})   # the client on CPU 0, as wrk
    proc = serve(db, cfg, port, workers)
    results: list[tuple[float, float, int]] = []   # (done at, latency ms, status)
    lock = threading.Lock()
    gate = threading.Barrier(connections + 1)
    stop_at = [0.0]

    def client(c: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        i = c
        gate.wait()
        while time.perf_counter() < stop_at[0]:
            t0 = time.perf_counter()
            conn.request("POST", paths[i % len(paths)], body=body, headers=headers)
            resp = conn.getresponse()
            resp.read()
            t1 = time.perf_counter()
            with lock:
                results.append((t1, (t1 - t0) * 1000.0, resp.status))
            i += connections

    try:
        threads = [threading.Thread(target=client, args=(c,)) for c in range(connections)]
        for t in threads:
            t.start()
        t_start = time.perf_counter()
        stop_at[0] = t_start + seconds
        gate.wait()
        for t in threads:
            t.join()
    finally:
        stop(proc)
    bad = sum(1 for r in results if r[2] != 200)
    print(f"cold start: {len(results):,} requests in {seconds:.0f} s after a restart, "
          f"{connections} connections over 1,000 endpoints (100 guilds), non-200: {bad}",
          flush=True)
    windows: dict[int, list[float]] = {}
    for done, ms, _ in results:
        windows.setdefault(int((done - t_start) / 0.5), []).append(ms)
    under_from = first_under = None
    for w in sorted(windows):
        lat = sorted(windows[w])
        p99 = lat[max(0, int(len(lat) * 0.99) - 1)]
        if w < 12 or w % 4 == 0:
            print(f"  {w * 0.5:4.1f}-{w * 0.5 + 0.5:4.1f} s: {len(lat):5d} answered, "
                  f"p50 {lat[len(lat) // 2]:6.1f} ms, p99 {p99:6.1f} ms", flush=True)
        if p99 < 50.0:
            under_from = w if under_from is None else under_from
            first_under = w if first_under is None else first_under
        else:
            under_from = None
    if first_under is not None:
        print(f"cold start: first 0.5 s window with p99 under 50 ms ends "
              f"{first_under * 0.5 + 0.5:.1f} s after the first request", flush=True)
    if under_from is None:
        print("cold start: p99 was not back under 50 ms for good", flush=True)
    else:
        print(f"cold start: p99 under 50 ms from {under_from * 0.5:.1f} s after the first "
              "request on", flush=True)


def measured(url: str, row: Rotation, args: argparse.Namespace,
             server_pid: int) -> tuple[dict[str, float], str]:
    """One measured wrk run, and with --cpu a line of the server's CPU per request."""
    before = cpu_split(server_pid) if args.cpu else None
    r = row.run(url, args.connections, args.duration)
    if before is None:
        return r, ""
    after = cpu_split(server_pid)
    n = max(1.0, r["total"])
    us = {"loop": 0.0, "threads": 0.0, "workers": 0.0}
    # Sums per part: a worker that exited meanwhile leaves its task's entry,
    # and its whole run time moves to the fork server's reaped children.
    for key, seconds in after.items():
        us[key[0]] += seconds / n * 1e6
    for key, seconds in before.items():
        us[key[0]] -= seconds / n * 1e6
    return r, (f"event loop {us['loop']:.0f} us, other server threads {us['threads']:.0f} us, "
               f"fork server and workers {us['workers']:.0f} us per request")


def paired(url: str, tmp: Path, label: str, row: Rotation, args: argparse.Namespace,
           server_pid: int) -> None:
    """The row K times, each right after the 1-endpoint load: K ratios and their median."""
    one = Rotation(tmp, "one", [big_path(1, 0)])
    ratios = []
    for _ in range(args.paired):
        b, b_cpu = measured(url, one, args, server_pid)
        r, r_cpu = measured(url, row, args, server_pid)
        ratios.append(r["rps"] / b["rps"])
        print(f"  {label:<30} {r['rps']:>8,.0f} req/s  {ratios[-1]:5.2f} of 1 endpoint "
              f"({b['rps']:,.0f} req/s, p99 {b['p99']:.2f} ms)  p50 {r['p50']:6.2f} ms  "
              f"p99 {r['p99']:7.2f} ms  non-2xx {r['errors'] + b['errors']:.0f}", flush=True)
        if args.cpu:
            print(f"      this row: {r_cpu}\n      1 endpoint: {b_cpu}", flush=True)
    print(f"  {label:<30} median {statistics.median(ratios):.2f} of 1 endpoint over "
          f"{len(ratios)} pairs ({min(ratios):.2f}-{max(ratios):.2f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds measured per row")
    parser.add_argument("--warmup", type=int, default=5, help="seconds of load before each row")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--skip-fill", metavar="DIR", help="reuse the database in DIR")
    parser.add_argument("--max-workers", type=int, default=0,
                        help="sandbox.max_workers (0: derived from memory)")
    parser.add_argument("--no-cold-start", action="store_true")
    parser.add_argument("--rows", default="", help="only these rows, e.g. 1,5,6 (1 = the "
                                                    "1-endpoint baseline)")
    parser.add_argument("--cpu", action="store_true",
                        help="print the server's CPU per request of each measured run "
                             "(event loop, other threads, workers)")
    parser.add_argument("--cold-connections", type=int, default=16,
                        help="connections of the cold-start case")
    parser.add_argument("--paired", type=int, default=0, metavar="K",
                        help="measure each row K times, each right after the 1-endpoint load, "
                             "and print the median of the K ratios")
    args = parser.parse_args()
    tmp = Path(args.skip_fill or tempfile.mkdtemp(prefix="scale-bench-"))
    cfg = tmp / "scale.toml"
    cfg.write_text(CONFIG.format(workers=args.workers, max_workers=args.max_workers))
    db_path = tmp / "scale.db"
    if not args.skip_fill:
        fill(db_path, cfg)
    db = f"sqlite:///{db_path}"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"database {db_path}; {args.connections} connections, warm-up: every endpoint of the "
          f"row called at least once, then {args.warmup} s; measured {args.duration} s; "
          f"sandbox.max_workers {args.max_workers or 'derived'}", flush=True)
    proc = serve(db, cfg, port, args.workers)
    base = None
    try:
        chosen = [int(x) for x in args.rows.split(",")] if args.rows else None
        for n, (label, distinct, sequence) in enumerate(rows(), 1):
            if chosen is not None and n not in chosen:
                continue
            warm = Rotation(tmp, "warm", distinct)
            while warm.at < warm.size:   # every endpoint of the row called at least once
                warm.run(url, args.connections, 2)
            row = Rotation(tmp, "row", sequence)
            if args.warmup:
                row.run(url, args.connections, args.warmup)
            if args.paired and n > 1:
                paired(url, tmp, label, row, args, proc.pid)
                continue
            r, r_cpu = measured(url, row, args, proc.pid)
            base = base or r["rps"]
            print(f"  {label:<30} {r['rps']:>8,.0f} req/s  {r['rps'] / base:5.2f} of 1 endpoint  "
                  f"p50 {r['p50']:6.2f} ms  p99 {r['p99']:7.2f} ms  non-2xx {r['errors']:.0f}",
                  flush=True)
            if r_cpu:
                print(f"      {r_cpu}", flush=True)
    finally:
        stop(proc)
    if not args.no_cold_start:
        cold_start(db, cfg, port, args.workers, args.cold_connections)


if __name__ == "__main__":
    main()
