"""What N processes taking turns cost by themselves, against what a worker's job adds.

    python bench/process_floor.py [--counts 2,10,100] [--jobs 60000]

Forks N children from a process that imported what the fork server imports
(heap frozen, as there) and sends them jobs round robin, two in flight (the
pool's two run slots), over socket pairs. Each child does one of:

- ``trivial``: receives a byte, builds a small dict, sends the byte back
  (what switching between N processes costs with almost no data of their own);
- ``job``: the worker's loop body on a real job frame (``protocol.recv_message``,
  ``check_job``, ``JobRunner.handle`` of the echo-validate script with the
  memory guard armed, ``worker._send``), without the OS hardening layers.

Prints jobs/s and every processor's busy time per job (run it on an otherwise
idle machine). The difference between the rows at N=2 and N=100 is the cost
of N processes' data no longer fitting the caches: small for ``trivial``, most
of a job for ``job`` (docs/performance.md, "Tenancy").
"""
from __future__ import annotations

import argparse
import gc
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import sandbox.zygote  # noqa: E402,F401  (what the fork server imports)
from sandbox import hardening, job_runner, limits, protocol, worker  # noqa: E402
from sandbox_bench import BODY, VALIDATE, busy_cpu_s, make_event  # noqa: E402

FRAME_CAP = 1 << 24


def _job(n: int, event: dict[str, Any], src: str | None = None) -> dict[str, Any]:
    return {"t": "job", "id": n, "key": "logic_floor", "ver": 1, "dig": b"d" * 32, "src": src,
            "ms": 1000, "mem": 4 << 20, "event": event, "until": time.monotonic() + 1e6}


def _child(sock: socket.socket, mode: str) -> None:
    """A child's loop; never returns."""
    if mode == "trivial":
        while True:
            data = sock.recv(64)
            if not data:
                os._exit(0)
            {"k": len(data), "v": [1, 2, 3]}  # noqa: B018 - a little Python work
            sock.sendall(data)
    signal.signal(signal.SIGALRM, lambda *_: None)   # the job's time-limit report
    runner = job_runner.JobRunner(worker.WorkerConfig(hardening.HardeningConfig(address_space=0)),
                                  limits.make_accountant(True))
    ready = select.poll()
    ready.register(sock.fileno(), select.POLLIN)
    while True:
        ready.poll()
        try:
            msg = protocol.check_job(protocol.recv_message(sock, protocol.MAX_JOB_BYTES,
                                                           runner.before_frame))
        except EOFError:
            os._exit(0)
        worker._send(sock, runner.handle(msg))


def run(n: int, jobs: int, mode: str) -> tuple[float, float]:
    """(jobs/s, busy µs per job) for ``n`` children."""
    event = make_event(BODY)
    gc.collect()
    gc.freeze()
    socks, pids = [], []
    for _ in range(n):
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            ours.close()
            _child(theirs, mode)
        theirs.close()
        socks.append(ours)
        pids.append(pid)
    try:
        if mode == "trivial":
            frames = [b"x"]
        else:
            for i, s in enumerate(socks):   # each child compiles once, then runs warm
                s.sendall(protocol.encode(_job(0, event, VALIDATE), FRAME_CAP))
                assert protocol.recv_message(s, FRAME_CAP)["r"]["status"] == 200
                for k in range(20):
                    s.sendall(protocol.encode(_job(k + 1, event), FRAME_CAP))
                    protocol.recv_message(s, FRAME_CAP)
            frames = [protocol.encode(_job(k, event), FRAME_CAP) for k in range(64)]
        poller = select.epoll()
        index = {s.fileno(): i for i, s in enumerate(socks)}
        for s in socks:
            poller.register(s.fileno(), select.EPOLLIN)
        sent = done = 0

        def send_next() -> None:
            nonlocal sent
            socks[sent % n].sendall(frames[sent % len(frames)])
            sent += 1

        busy0, t0 = busy_cpu_s(), time.perf_counter()
        for _ in range(2):
            send_next()
        while done < jobs:
            for fd, _ in poller.poll():
                s = socks[index[fd]]
                if mode == "trivial":   # a child sent two jobs answers both in one read
                    answered = len(s.recv(64))
                else:
                    protocol.recv_message(s, FRAME_CAP)
                    answered = 1
                done += answered
                for _ in range(answered):
                    if sent < jobs:
                        send_next()
        elapsed = time.perf_counter() - t0
        return jobs / elapsed, (busy_cpu_s() - busy0) / jobs * 1e6
    finally:
        for s in socks:
            s.close()
        for pid in pids:
            os.waitpid(pid, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--counts", default="2,10,100")
    parser.add_argument("--jobs", type=int, default=60000)
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    for mode in ("trivial", "job"):
        for n in counts:
            rate, cpu = run(n, args.jobs, mode)
            print(f"{mode:8s} {n:5d} processes: {rate:9,.0f} jobs/s, {cpu:6.1f} us of CPU a job",
                  flush=True)


if __name__ == "__main__":
    main()
