"""What the HTTP front's hardening costs per invoke request, piece by piece.

The hardening of the HTTP front (back-pressure, limits, charset allow-list,
bounded JSON numbers, the secret redacted from history, the records journal)
is woven through the request path, so no build of today's code without it
can be run beside this one (the branch it was built on can: `invoke_bench.py
--before DIR --after DIR`). This bench times, in this process, the code each piece adds to the
request `bench/invoke_bench.py` sends (the same body, headers and script
reply), against what the path does without it, and relates the sum to the
server's CPU per request measured by a short wrk run of `logic serve` (the
same set-up as invoke_bench: server and workers on CPU 1, wrk on CPU 0).

    python bench/http_fixes_cost.py [--duration 5]

The journal's cost is also measured end to end by `invoke_bench.py
--no-journal`; the parser's slicing and the pipelining/head-size checks are
a few integer comparisons per read and are not timed here (below the
resolution of this method).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import invoke_setup as ib  # noqa: E402

from service.http.event import parse_body  # noqa: E402
from service.http.journal import Journal  # noqa: E402
from service.http.journal_facts import without_secret  # noqa: E402
from service.http.redaction import Redactor  # noqa: E402


def per_call_us(fn: Callable[[], Any], n: int = 50_000, reps: int = 7) -> float:
    """Median over `reps` of the mean CPU time of `fn`, in µs."""
    fn()
    runs = []
    for _ in range(reps):
        t0 = time.process_time()
        for _ in range(n):
            fn()
        runs.append((time.process_time() - t0) / n * 1e6)
    return statistics.median(runs)


def request_facts(secret: str) -> tuple[Any, ...]:
    """The journaled facts of one invoke_bench request (its headers, body and reply)."""
    now = time.time()
    headers = {"host": "127.0.0.1:8080", "content-type": "application/json",
               "content-length": str(len(ib.BODY))}
    reply = json.dumps({"ok": True, "double": 42}).encode()
    return (1, 200, True, True, "9f1c2e7a5b3d4c6e8f0a1b2c", now, now + 0.004, 200, "127.0.0.1",
            "POST", {}, headers, ib.BODY.encode(), "", [["Content-Type", "application/json"]],
            reply, "", None, None, "", None, None, False, False, 1)


def pieces(secret: str, tmp: Path) -> list[tuple[str, float]]:
    raw = ib.BODY.encode()
    body = per_call_us(lambda: parse_body("application/json", raw))
    plain = per_call_us(lambda: json.loads(raw.decode("utf-8")))
    facts = request_facts(secret)
    redact = per_call_us(lambda: without_secret(facts, secret))
    by_name = Redactor(None)
    query, headers, response_headers = facts[10], facts[11], facts[14]
    names = per_call_us(lambda: (by_name.mapping(query), by_name.mapping(headers),
                                 by_name.mapping(dict(response_headers))))
    journal = Journal(tmp / "journal")
    lock = journal.lock

    def append() -> None:
        with lock:
            journal.append(facts)
    appended = per_call_us(append, n=20_000)
    journal.close()
    return [
        ("JSON body: charset allow-list, bounded numbers, surrogate check", body - plain),
        ("presented secret redacted from the journaled facts", redact),
        ("credential-named values redacted (writer thread)", names),
        ("records journal: pack and copy into the mapped segment", appended),
    ]


def server_cpu_per_request(tmp: Path, duration: int) -> tuple[float, float]:
    db, cfg, script_id, _secret, lua = ib.bench_endpoint(tmp, 2)
    port = ib.free_port()
    env = {**ib.SERVE_ENV, **os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(["taskset", "-c", str(ib.SERVER_CPU), ib.LOGIC, "--database-url", db,
                             "--config", str(cfg), "serve", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        ib.wait_listening(proc)
        url = f"http://127.0.0.1:{port}/endpoints/1000/{script_id}"
        ib.run_wrk(url, str(lua), 4, 2)
        run = ib.measure("logic-endpoints", proc.pid, url, str(lua), 16, duration)
        return run["parent_us"], run["rps"]
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=5, help="seconds of wrk")
    args = parser.parse_args()
    if not shutil.which("wrk"):
        sys.exit("http_fixes_cost: wrk is not installed (apt-get install wrk)")
    tmp = Path(tempfile.mkdtemp(prefix="logic-fixes-"))
    try:
        server_us, rps = server_cpu_per_request(tmp, args.duration)
        rows = pieces("lsk_" + "b" * 43, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"server process CPU per request (wrk, 16 connections, {rps:,.0f} req/s): "
          f"{server_us:.0f} us")
    total = 0.0
    for name, us in rows:
        total += max(us, 0.0)
        print(f"  {us:6.2f} us  {us / server_us:6.2%}  {name}")
    print(f"  {total:6.2f} us  {total / server_us:6.2%}  together")


if __name__ == "__main__":
    main()
