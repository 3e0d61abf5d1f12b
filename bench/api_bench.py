"""Invocations per second with and without a concurrent admin API client, in one run.

One `logic serve` (pinned to CPU 1, its workers included) serves the demo-like
endpoint of bench/invoke_bench.py under wrk (CPU 0). Rounds alternate between
wrk alone and wrk while an API client (CPU 0 as well) reads history
(`?limit=50`) and statistics in a loop as fast as the server answers; past
its token's 600 calls a minute it is answered 429 and waits as `Retry-After`
says (`--ignore-retry-after`: it retries at once, as a careless client
would). Those reads run in the server's lower-priority reading processes
(service/api/readers.py); the target is an invocation throughput drop of at
most 10 %.

    python bench/api_bench.py [--duration 5] [--rounds 3] [--connections 16]
                              [--ignore-retry-after]

Prints each run, then the median throughput of both kinds, their ratio, and
how many API calls the client made per second. Needs `wrk` and `taskset`.
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from invoke_setup import (LOGIC, SERVE_ENV, SERVER_CPU, bench_endpoint,  # noqa: E402
                          free_port, logic, median_run, measure, run_wrk, wait_listening)

CLIENT = """
import http.client, sys, time
port, token, path, seconds = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
polite = sys.argv[5] == "polite"
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
headers = {"Authorization": "Bearer " + token}
calls, bad, refused, end = 0, 0, 0, time.monotonic() + seconds
while time.monotonic() < end:
    for tail in ("/history?limit=50", "/stats"):
        conn.request("GET", path + tail, headers=headers)
        resp = conn.getresponse()
        resp.read()
        calls += 1
        bad += resp.status != 200 and resp.status != 429
        if resp.status == 429:
            refused += 1
            if polite:  # as docs/admin-api.md asks of clients
                time.sleep(min(float(resp.getheader("Retry-After", "1")),
                               max(0.0, end - time.monotonic())))
print(calls, bad, refused)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=5, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each kind")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ignore-retry-after", action="store_true",
                        help="the API client retries refused calls at once instead of "
                             "waiting as Retry-After says")
    args = parser.parse_args()
    if not shutil.which("wrk"):
        sys.exit("api_bench: wrk is not installed (apt-get install wrk)")

    tmp = Path(tempfile.mkdtemp(prefix="logic-api-bench-"))
    db, cfg, script_id, _, lua = bench_endpoint(tmp, args.workers)
    token = str(logic(db, str(cfg), "token", "create", "--user", "42")["token"])
    (tmp / "client.py").write_text(CLIENT)
    api_path = f"/api/v1/guilds/1000/scripts/{script_id}"

    svc = None
    alone, loaded, api_rates = [], [], []
    try:
        port = free_port()
        env = {**SERVE_ENV, **os.environ, "PYTHONUNBUFFERED": "1"}
        svc = subprocess.Popen(["taskset", "-c", str(SERVER_CPU), LOGIC, "--database-url", db,
                                "--config", str(cfg), "serve", "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        wait_listening(svc)
        url = f"http://127.0.0.1:{port}/endpoints/1000/{script_id}"
        run_wrk(url, str(lua), 4, 2)        # warm up: caches, compiled script in every worker
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.request("GET", api_path + "/stats", headers={"Authorization": f"Bearer {token}"})
        assert conn.getresponse().status == 200
        print(f"logic serve, {args.workers} workers, c={args.connections}; {args.rounds} "
              f"alternating rounds of {args.duration}s (alone / with an API client)", flush=True)
        for _ in range(args.rounds):
            alone.append(measure("alone", svc.pid, url, str(lua), args.connections, args.duration))
            client = subprocess.Popen(
                ["taskset", "-c", "0", sys.executable, str(tmp / "client.py"), str(port), token,
                 api_path, str(args.duration + 1),
                 "rude" if args.ignore_retry_after else "polite"],
                stdout=subprocess.PIPE, text=True)
            time.sleep(0.5)
            loaded.append(measure("with API client", svc.pid, url, str(lua), args.connections,
                                  args.duration))
            out, _ = client.communicate(timeout=120)
            calls, bad, refused = (int(x) for x in out.split())
            api_rates.append(calls / (args.duration + 1))
            print(f"  API client: {calls / (args.duration + 1):.0f} calls/s, {bad} failed, "
                  f"{refused} answered 429", flush=True)
        svc.send_signal(signal.SIGTERM)
        svc.wait(60)
    finally:
        if svc is not None and svc.poll() is None:
            svc.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    a, b = median_run(alone), median_run(loaded)
    print(f"\nmedian: alone {a['rps']:.0f} req/s, with API client {b['rps']:.0f} req/s "
          f"({b['rps'] / a['rps']:.1%}; target >= 90%), p99 {a['p99']:.2f} vs {b['p99']:.2f} ms, "
          f"API client {sorted(api_rates)[len(api_rates) // 2]:.0f} calls/s")


if __name__ == "__main__":
    main()
