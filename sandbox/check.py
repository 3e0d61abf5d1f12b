"""Operator check: start a small pool and verify each worker's hardening from outside.

Run: ``python -m sandbox.check`` (exit status 1 when a layer is missing).

It prints what the workers reported (``pool.hardening``) and, independently
of that report, what the kernel says about each worker process in
``/proc/<pid>/``: uid, NoNewPrivs, seccomp mode, limits, network namespace
and open descriptors; then it compiles a small script through the
save-time compile process (``sandbox.compile_gate``).  It runs no script
and needs no test hook.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from typing import Any

from sandbox.compile_gate import check_source, inactive_layers
from sandbox.pool import Pool

_CHECK_SOURCE = "import statistics\non endpoint(event):\n    event.reply(statistics.mode([1]))\n"


def inspect(pid: int) -> dict[str, Any]:
    """What /proc says about one worker."""
    base = f"/proc/{pid}"
    with open(f"{base}/status") as f:
        status = dict(line.rstrip("\n").split(":", 1) for line in f if ":" in line)
    with open(f"{base}/limits") as f:
        limit_lines = f.read().splitlines()[1:]
    wanted = ("Max address space", "Max cpu time", "Max open files", "Max file size",
              "Max core file size", "Max processes")
    limits = {}
    for line in limit_lines:
        for name in wanted:
            if line.startswith(name):
                limits[name] = line[len(name):].split()[:2]
    # Workers are undumpable (PR_SET_DUMPABLE 0): without root, their
    # ns/ and fd/ entries are not readable by the service's user; say so
    # instead of failing.
    try:
        own_netns: bool | None = os.readlink(f"{base}/ns/net") != os.readlink("/proc/self/ns/net")
    except PermissionError:
        own_netns = None
    try:   # the worker's root: an empty, removed directory where it could chroot
        root: str | None = os.readlink(f"{base}/root")
    except (PermissionError, FileNotFoundError):
        root = None
    try:
        listed = sorted(int(fd) for fd in os.listdir(f"{base}/fd"))
        # Past the channel and /dev/null: what each descriptor is open on.
        fd_targets: list[str] | None = sorted(os.readlink(f"{base}/fd/{fd}")
                                              for fd in listed if fd > 3)
        fds: list[int] | None = listed
    except (PermissionError, FileNotFoundError):
        fds = fd_targets = None
    return {
        "uid": status.get("Uid", "").split()[:1],
        "no_new_privs": status.get("NoNewPrivs", "").strip() == "1",
        "seccomp_filter": status.get("Seccomp", "").strip() == "2",
        "own_network_namespace": own_netns,
        "root": root,
        "fds": fds,
        "fd_targets": fd_targets,
        "limits": limits,
    }


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    pool = Pool(size=1)
    pool.start()
    try:
        report: dict[str, Any] = {"reported": pool.hardening, "notes": pool.hardening_notes,
                                  "workers": {pid: inspect(pid) for pid in pool.worker_pids}}
    finally:
        asyncio.run(pool.stop())
    # The save-time compile process starts, hardens itself and compiles.
    verdict = check_source(_CHECK_SOURCE)
    inactive = inactive_layers()
    report["compile_gate"] = {"ok": verdict.ok, "errors": [e.message for e in verdict.errors],
                              "inactive": inactive}
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0 if all(pool.hardening.values()) and verdict.ok and not inactive else 1


if __name__ == "__main__":
    sys.exit(main())
