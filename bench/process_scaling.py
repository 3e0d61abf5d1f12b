"""`invoke_bench.py --processes N`: requests/s of 1 against N front processes, in one run.

Two `logic serve` instances on one database, side by side: `--processes 1`
and `--processes N`, each front with `--workers` sandbox workers. Nothing is
pinned: the point is to use every core, so the servers, their workers and wrk
(one thread) share the machine's cores, and wrk's own CPU (~10-15 % of a core
at these rates) is taken from the servers alike. The runs alternate between
the two servers, so a shared machine that speeds up or slows down during the
bench affects both alike; the median run of each is compared.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import psutil

LATENCY = re.compile(r"\s(50|99)%\s+([\d.]+)(us|ms|s)")


def _wrk(url: str, lua: str, connections: int, duration: int) -> dict[str, float]:
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency",
                          "-s", lua, url], check=True, capture_output=True, text=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                       out)
    lat = {m.group(1): float(m.group(2)) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[m.group(3)]
           for m in LATENCY.finditer(out)}
    return {"rps": rps, "p50": lat.get("50", 0.0), "p99": lat.get("99", 0.0),
            "errors": (int(non2xx.group(1)) if non2xx else 0)
            + (sum(int(g) for g in errors.groups()) if errors else 0)}


def _tree_cpu(pid: int) -> float:
    """CPU seconds of a server and every process under it (fronts, sandbox workers)."""
    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _start(logic: str, db: str, cfg: Path, port: int, processes: int,
           env: dict[str, str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen([logic, "--database-url", db, "--config", str(cfg), "serve",
                             "--port", str(port), "--processes", str(processes)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    seen = []
    want = "fronts ready" if processes > 1 else "listening on"
    for line in proc.stdout:
        seen.append(line)
        if want in line:
            break
    else:
        raise RuntimeError("server did not start:\n" + "".join(seen[-5:]))
    return proc


def compare(args: argparse.Namespace, logic: str, db: str, cfg: Path, lua: Path, path: str,
            env: dict[str, str], free_port: Callable[[], int],
            median_run: Callable[[list[dict[str, float]]], dict[str, float]]) -> None:
    """Run both servers, alternate wrk between them, print the ratio per connection count."""
    conns = [int(c) for c in args.connections.split(",")]
    servers: dict[int, tuple[subprocess.Popen[str], str]] = {}
    try:
        for n in (1, args.processes):
            port = free_port()
            journal = {"LOGIC_RECORDS_JOURNAL": str(cfg.parent / f"journal-{n}")}
            servers[n] = (_start(logic, db, cfg, port, n, {**env, **journal}),
                          f"http://127.0.0.1:{port}{path}")
        for _, url in servers.values():
            _wrk(url, str(lua), 8, 2)  # warm up: caches, the compiled script in every worker
        print(f"1 vs {args.processes} front processes ({args.workers} workers each), nothing "
              f"pinned, wrk -t1 on the same cores; {args.rounds} alternating rounds of "
              f"{args.duration}s", flush=True)
        results: dict[int, dict[int, dict[str, float]]] = {c: {} for c in conns}
        for c in conns:
            runs: dict[int, list[dict[str, float]]] = {n: [] for n in servers}
            for _ in range(args.rounds):
                for n, (proc, url) in servers.items():
                    before = _tree_cpu(proc.pid)
                    r = _wrk(url, str(lua), c, args.duration)
                    r["cpu_us"] = (_tree_cpu(proc.pid) - before) / max(1.0, r["rps"]
                                                                      * args.duration) * 1e6
                    runs[n].append(r)
                    print(f"  processes={n:<2} c={c:<3} {r['rps']:>8.0f} req/s  "
                          f"p50 {r['p50']:6.2f} ms  p99 {r['p99']:6.2f} ms  "
                          f"cpu/req {r['cpu_us']:4.0f} us  errors {r['errors']:.0f}", flush=True)
            for n in servers:
                results[c][n] = median_run(runs[n])
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(90)
    finally:
        for proc, _ in servers.values():
            if proc.poll() is None:
                proc.kill()
    print(f"\nmedian runs, {args.processes} processes / 1 process:")
    for c in conns:
        one, many = results[c][1], results[c][args.processes]
        print(f"  c={c:<3} throughput {many['rps'] / one['rps']:5.2f}x   "
              f"({many['rps']:.0f} vs {one['rps']:.0f} req/s)   "
              f"p99 {many['p99']:.2f} vs {one['p99']:.2f} ms")
