"""How much private memory one job touches in a warm worker: what a job costs in cache
when 100 guilds' workers take turns on two cores.

    python bench/worker_footprint.py            # needs root (writes /proc/PID/clear_refs)

A child forked from a process that imported what the fork server imports (heap
frozen, as there) runs the worker's loop body on a socket: receive a job frame,
run it with `sandbox.job_runner.JobRunner`, send the reply. The parent clears the
child's page reference bits (`/proc/PID/clear_refs`), lets it run one job, and
sums `Referenced` over the child's writable mappings in `/proc/PID/smaps`: the
private pages (after copy-on-write) one job reads or writes. A control round
trip (the child only acknowledges) is subtracted. No hardening is applied, so
this is the job's own footprint, not the worker's start-up.
"""
from __future__ import annotations

import gc
import os
import select
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import sandbox.zygote  # noqa: E402,F401  (what the fork server imports)
from sandbox import hardening, job_runner, limits, protocol, worker  # noqa: E402
from sandbox_bench import BODY, VALIDATE, make_event  # noqa: E402

TRIVIAL = "on endpoint(event):\n    event.reply(1)\n"
ROUNDS = 15


def touched_kb(pid: int) -> int:
    """`Referenced` kB over the writable mappings of `pid`."""
    total, writable = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                writable = "w" in fields[1]
            elif fields[0] == "Referenced:" and writable:
                total += int(fields[1])
    return total


def clear(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("1")


def measure(source: str) -> tuple[float, float]:
    """(control round trip kB, one job kB), medians of ROUNDS."""
    event = make_event(BODY)
    gc.collect()
    gc.freeze()
    ours, theirs = socket.socketpair()
    ctl_r, ctl_w = os.pipe()
    ack_r, ack_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        ours.close()
        os.close(ctl_w)
        os.close(ack_r)
        runner = job_runner.JobRunner(worker.WorkerConfig(hardening.HardeningConfig(address_space=0)),
                                limits.make_accountant(True))
        ready = select.poll()
        ready.register(theirs.fileno(), select.POLLIN)
        while True:
            command = os.read(ctl_r, 1)
            if not command:
                os._exit(0)
            if command == b"j":
                ready.poll()
                job = protocol.check_job(protocol.recv_message(theirs, protocol.MAX_JOB_BYTES))
                worker._send(theirs, runner.handle(job))
            os.write(ack_w, b"k")
    theirs.close()
    os.close(ctl_r)
    os.close(ack_w)

    def job(n: int, src: str | None) -> dict[str, Any]:
        return {"t": "job", "id": n, "key": "logic_footprint", "ver": 1, "dig": b"d" * 32,
                "src": src, "ms": 1000, "mem": 4 << 20, "event": event,
                "until": time.monotonic() + 1.0}

    def run(n: int, src: str | None = None) -> None:
        os.write(ctl_w, b"j")
        ours.sendall(protocol.encode(job(n, src), 1 << 24))
        os.read(ack_r, 1)
        reply = protocol.recv_message(ours, 1 << 24)
        assert reply["r"]["status"] == 200, reply

    try:
        run(0, source)
        for n in range(1, 300):   # warm: specialised bytecode, caches filled
            run(n)
        control, one_job = [], []
        for n in range(ROUNDS):
            clear(pid)
            os.write(ctl_w, b"n")
            os.read(ack_r, 1)
            control.append(touched_kb(pid))
            clear(pid)
            run(1000 + n)
            one_job.append(touched_kb(pid))
    finally:
        os.close(ctl_w)
        os.waitpid(pid, 0)
        ours.close()
    return statistics.median(control), statistics.median(one_job)


def main() -> None:
    if os.geteuid() != 0:
        sys.exit("worker_footprint: needs root (it writes /proc/PID/clear_refs)")
    for name, source in (("trivial (event.reply(1))", TRIVIAL), ("echo-validate", VALIDATE)):
        control, one_job = measure(source)
        print(f"{name:26s} one job touches {one_job - control:6.0f} kB of private memory "
              f"(~{(one_job - control) / 4:.0f} pages; control round trip {control:.0f} kB)")


if __name__ == "__main__":
    main()
