"""Instructions the event loop executes per invoke request, counted by callgrind.

    python bench/loop_instructions.py [--before DIR] [--after DIR] [--requests N] [--cache]

Throughput on a shared 2-vCPU host moves by 5-25 % from one run to the next,
more than the changes it is asked to judge. This counts instead: `logic serve`
runs under `valgrind --tool=callgrind` (its workers, exec'd by the fork
server, run natively), a Python client sends N requests (16 keep-alive
connections, the invoke bench's request and script) and the count of the
loop thread's user-space instructions over them is divided by N. The same
code gives the same figure to within about 1 %, whatever else the machine
does; the kernel's part (system calls, wake-ups) and cache misses are not
in it, so it ranks changes of the Python on the loop, not of the system:
fewer instructions need not mean a faster server (docs/performance.md, the
request path compiled with mypyc), but more of them show a change that adds
work to every request.

`--before DIR` also counts a server run with the packages of another tree
(e.g. `git archive REV service sandbox models setup.py setup.cfg pyproject.toml
| tar -x -C DIR` and `python setup.py build_ext --inplace` there), and prints
the ratio; `--after DIR` serves the first column from a tree too. Needs
valgrind (Debian package `valgrind`). Runs take about 30 s per 800 requests.

`--cache` also simulates the caches (callgrind's `--cache-sim`: a 32 KiB L1
and, as the last level, 1 MiB, the L2 a core of these hosts has) and prints
the misses per request: how much of what a request touches is new to the
loop's caches. The simulation sees the loop alone, so it misses what the
workers and other threads evict between its turns: a lower bound.
"""
from __future__ import annotations

import argparse
import glob
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from invoke_setup import (BODY, LOGIC, SERVE_ENV, bench_endpoint, free_port, tree_env,
                          wait_listening)


#: ``--cache``: a 32 KiB first level and, as the last, the 1 MiB a core of
#: the hosts this was written on has as L2 (what the loop keeps of its own
#: while the core runs workers too), not the host's shared L3.
CACHE_SIM = ["--cache-sim=yes", "--D1=32768,8,64", "--I1=32768,8,64", "--LL=1048576,16,64"]


def count(tree: str | None, tmp: Path, requests: int, clients: int,
          cache: bool = False) -> dict[str, dict[str, float]]:
    """Per thread ("loop", "records"), callgrind's events per request of one
    server: ``Ir`` (instructions), and with `cache` the simulated misses."""
    tmp.mkdir()
    env = {**SERVE_ENV, **os.environ, "PYTHONUNBUFFERED": "1"}
    if tree:
        env = tree_env(tree, env, tmp / "journal")
    else:
        env["LOGIC_RECORDS_JOURNAL"] = str(tmp / "journal")
    db, cfg, script_id, secret, _ = bench_endpoint(tmp, 2, env=env)
    port = free_port()
    out = tmp / "callgrind"
    server = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--separate-threads=yes", "--instr-atstart=no",
         *(CACHE_SIM if cache else []), f"--callgrind-out-file={out}.%p", sys.executable, LOGIC,
         "--database-url", db, "--config", str(cfg), "serve", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_listening(server)
        path = f"/endpoints/1000/{script_id}"
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {secret}"}
        statuses = _load(port, path, headers, 200, clients)   # warm: caches, compiled script
        if set(statuses) != {200}:
            raise SystemExit(f"loop_instructions: warm-up answered {sorted(set(statuses))}")
        subprocess.run(["callgrind_control", "--instr=on", str(server.pid)], check=True,
                       capture_output=True)
        statuses = _load(port, path, headers, requests, clients)
        subprocess.run(["callgrind_control", "--dump", str(server.pid)], check=True,
                       capture_output=True)
        if set(statuses) != {200}:
            raise SystemExit(f"loop_instructions: answered {sorted(set(statuses))}")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
    per: dict[str, dict[str, float]] = {}
    # The dump asked for is part 1 (`<out>.<pid>.1-<thread>`); thread 1 is the
    # event loop, thread 2 the records writer.
    for name in glob.glob(f"{out}.{server.pid}.1-*"):
        text = Path(name).read_text(errors="replace")
        events = re.search(r"^events: (.+)$", text, re.M)
        total = re.search(r"^(?:summary|totals): ([\d ]+)$", text, re.M)
        thread = re.search(r"^thread: (\d+)", text, re.M)
        if events and total and thread:
            part = per.setdefault({"1": "loop", "2": "records"}.get(thread.group(1), "other"), {})
            for event, value in zip(events.group(1).split(), total.group(1).split()):
                part[event] = part.get(event, 0.0) + int(value) / len(statuses)
    return per


def _show(name: str, per: dict[str, dict[str, float]], cache: bool) -> str:
    if not cache:
        return f"{name}: " + json.dumps({part: round(ev["Ir"]) for part, ev in sorted(per.items())
                                         if ev.get("Ir")}) + " instructions per request"
    lines = [f"{name}, per request:"]
    for part, ev in sorted(per.items()):
        if not ev.get("Ir"):
            continue   # a thread that ran nothing while counted
        lines.append(f"  {part:<8} instructions {ev['Ir']:>9,.0f}  L1 data misses "
                     f"{ev.get('D1mr', 0) + ev.get('D1mw', 0):>7,.0f}  L1 code misses "
                     f"{ev.get('I1mr', 0):>7,.0f}  misses of a 1 MiB last level "
                     f"{ev.get('DLmr', 0) + ev.get('DLmw', 0) + ev.get('ILmr', 0):>6,.0f}")
    return "\n".join(lines)


def _load(port: int, path: str, headers: dict[str, str], n: int, clients: int) -> list[int]:
    statuses: list[int] = []

    def client(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        for _ in range(k):
            conn.request("POST", path, BODY, headers)
            answer = conn.getresponse()
            answer.read()
            statuses.append(answer.status)
        conn.close()

    threads = [threading.Thread(target=client, args=(n // clients,)) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=None, help="also count a server of the tree in DIR")
    parser.add_argument("--after", default=None, help="count the first server from DIR too")
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--cache", action="store_true",
                        help="also simulate the caches (L1 and a 1 MiB last level; ~3x slower)")
    args = parser.parse_args()
    if not shutil.which("valgrind"):
        sys.exit("loop_instructions: valgrind is not installed (apt-get install valgrind)")
    tmp = Path(tempfile.mkdtemp(prefix="logic-instr-"))
    try:
        ours = count(args.after, tmp / "after", args.requests, args.clients, args.cache)
        print(_show(args.after or "this checkout", ours, args.cache), flush=True)
        if args.before:
            theirs = count(args.before, tmp / "before", args.requests, args.clients, args.cache)
            print(_show(args.before, theirs, args.cache))
            print(f"event loop: {ours['loop']['Ir'] / theirs['loop']['Ir']:.3f} of before's "
                  "instructions")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
