"""Throughput and latency of the invoke endpoint against a bare Tornado handler, in one run.

Both servers do the same work unit (bearer-token check, JSON parse of a ~300-byte
body, validation of two fields, JSON reply); Logic Endpoints adds everything it
really does: endpoint lookup, argon2 secret check (cached), rate limit, sandbox
worker round trip, history and statistics records. wrk (one thread) is pinned to
CPU 0 and the server under test to CPU 1 (workers included), as in
../shared/PERFORMANCE.md.

    python bench/invoke_bench.py [--duration 5] [--rounds 3] [--connections 4,16,64]
                                 [--no-journal] [--before DIR [--after DIR]] [--together]
                                 [--processes N] [--database postgresql://...]

`--no-journal` adds a third server in the same alternating rounds: logic serve
with `records.journal = "off"`, so the journal's cost is the ratio of the two
logic-endpoints runs (printed at the end). `--before DIR` does the same with
the packages of another tree (`git archive REV service sandbox models setup.py
setup.cfg pyproject.toml | tar -x -C DIR`, then `python setup.py build_ext
--inplace` in DIR for the sandbox's allocator guard), imported first through
PYTHONPATH: the cost of a branch's changes, measured in one run. `--after DIR`
serves the logic-endpoints side from another tree too (by default it is the
installed package), so two commits neither of which is the checkout compare
in one run, e.g. a branch's tip against its fork point. Each tree gets its
own database, made by its own CLI.

`--together` (with `--no-journal` or `--before`) loads the two logic serve
processes at the same time in each round instead of one after the other, both
on the server's core: on a host whose speed drifts by ±10 % from one run to
the next, the rounds' ratios then spread by a few percent. What it compares
is throughput while the two share the core, which weighs each server's event
loop most (the one thread that is always busy); the bare handler is not loaded.

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
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from invoke_setup import (HERE, LOGIC, SERVE_ENV, SERVER_CPU, bench_endpoint, free_port,
                          fresh_database, measure, median_run, run_wrk, run_wrk_together,
                          tree_env, wait_listening)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=5, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per server")
    parser.add_argument("--connections", default="4,16,64")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-journal", action="store_true",
                        help="also run logic serve without the records journal")
    parser.add_argument("--before", default=None,
                        help="also run logic serve with the packages of the tree in DIR")
    parser.add_argument("--together", action="store_true",
                        help="with --no-journal or --before: load both servers at once each round")
    parser.add_argument("--after", default=None,
                        help="serve the logic-endpoints side from the tree in DIR too")
    parser.add_argument("--processes", type=int, default=0,
                        help="compare 1 and N front processes instead (nothing pinned)")
    parser.add_argument("--database", default=None, metavar="URL",
                        help="also run logic serve on PostgreSQL (a fresh database on this server)")
    args = parser.parse_args()
    if args.database and not args.database.startswith(("postgresql://", "postgres://")):
        sys.exit("invoke_bench: --database takes a postgresql:// URL")
    if args.after and not args.before:
        sys.exit("invoke_bench: --after compares with --before DIR")
    if args.together and (args.database or not (args.no_journal or args.before)):
        sys.exit("invoke_bench: --together compares two servers: --no-journal or --before DIR")
    if args.after and args.database:
        sys.exit("invoke_bench: --database runs the installed package; not with --after")
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
        bare_url = f"http://127.0.0.1:{bare_port}{path}"
        our_db, our_cfg, our_path, our_lua, our_env = db, cfg, path, lua, env
        if args.after:
            our_env = tree_env(args.after, env, tmp / "after-journal")
            (tmp / "after").mkdir()
            our_db, our_cfg, our_id, _, our_lua = bench_endpoint(tmp / "after", args.workers,
                                                                 env=our_env)
            our_path = f"/endpoints/1000/{our_id}"
        svc = subprocess.Popen(["taskset", "-c", str(SERVER_CPU), LOGIC, "--database-url",
                                our_db, "--config", str(our_cfg), "serve", "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=our_env)
        procs.append(svc)
        wait_listening(svc)
        our_url = f"http://127.0.0.1:{port}{our_path}"
        nojournal = None
        if args.no_journal or args.before:
            plain_port = free_port()
            # Its own journal: a journal belongs to one process (service.http.journal).
            other_env = (tree_env(args.before, env, tmp / "before-journal") if args.before
                         else {**our_env, "LOGIC_RECORDS_JOURNAL": "off"})
            plain_db, plain_cfg, plain_path, plain_lua = our_db, our_cfg, our_path, our_lua
            if args.before:
                # Another tree refuses a newer schema and may store secrets in
                # another form: it gets its own database, made by its own CLI.
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
        if not args.together:  # warm up: caches, compiled script in every worker
            run_wrk(bare_url, str(lua), 4, 2)
        run_wrk(our_url, str(our_lua), 4, 2)
        if args.together:
            together(args, conns, ("logic-endpoints", our_url, str(our_lua)),
                     ("before" if args.before else "no journal", plain_url, str(plain_lua)))
        else:
            print(f"bare: a Tornado handler doing the work in-process; logic-endpoints: logic "
                  f"serve, {args.workers} workers, secret, rate limit, sandbox, history, "
                  f"statistics. {args.rounds} alternating rounds of {args.duration}s", flush=True)
        for c in [] if args.together else conns:
            runs_bare, runs_ours, runs_plain, runs_pg = [], [], [], []
            for r in range(args.rounds):
                runs_bare.append(measure("bare", bare.pid, bare_url, str(lua), c, args.duration))
                plan = [("logic-endpoints", svc.pid, our_url, str(our_lua), runs_ours)]
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

    if args.together:
        return
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


def together(args: argparse.Namespace, conns: list[int], ours: tuple[str, str, str],
             other: tuple[str, str, str]) -> None:
    """Both servers loaded at once each round (`run_wrk_together`): their
    throughputs' ratio, round by round, then the median and spread."""
    print(f"{ours[0]} and {other[0]} loaded together, {args.rounds} rounds of "
          f"{args.duration}s", flush=True)
    for c in conns:
        ratios = []
        for r in range(args.rounds):
            # Which wrk starts first alternates between rounds.
            pair = [ours, other] if r % 2 == 0 else [other, ours]
            runs = run_wrk_together([(url, lua) for _, url, lua in pair], c, args.duration)
            if r % 2:
                runs.reverse()
            ratios.append(runs[0]["rps"] / runs[1]["rps"])
            print(f"  c={c:<3} round {r + 1}: {ours[0]} {runs[0]['rps']:.0f} req/s, "
                  f"{other[0]} {runs[1]['rps']:.0f} req/s (p99 {runs[0]['p99']:.2f} vs "
                  f"{runs[1]['p99']:.2f} ms)", flush=True)
        ratios.sort()
        print(f"\n{ours[0]} / {other[0]}, loaded together:\n  c={c:<3} throughput "
              f"{ratios[len(ratios) // 2]:6.1%} (median of the rounds' ratios; "
              f"{ratios[0]:.1%} .. {ratios[-1]:.1%})")


if __name__ == "__main__":
    main()
