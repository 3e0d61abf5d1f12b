"""What the fair scheduler (sandbox/scheduler.py) costs against a plain FIFO queue.

    python bench/scheduler_bench.py              # bookkeeping per request, in process
    python bench/scheduler_bench.py --tree DIR   # also write a copy of this checkout
                                                 # whose pool queues FIFO, then:
    python bench/invoke_bench.py --before DIR    # end to end, in one run

The in-process part drives each scheduler the way the pool does on one
guild under load (two run slots busy, requests waiting): per request one
`finish`, one `pop` and one `push`.  The reference is `bench/fifo_scheduler.py`.
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class Req:
    __slots__ = ("guild", "queued", "deprioritised", "excess")

    def __init__(self, guild: str) -> None:
        self.guild = guild
        self.queued = False
        self.deprioritised = False
        self.excess = False


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"sched_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_request_us(scheduler_cls: Any, n: int, waiting: int = 14) -> float:
    s = scheduler_cls(2)
    running: list[Req] = []
    for _ in range(2 + waiting):
        r = Req("g")
        if not s.waiting and s.start("g") >= 0:
            running.append(r)
        else:
            s.push(r)
    t0 = time.perf_counter()
    for _ in range(n):
        done = running.pop(0)
        s.finish("g", 0.0002, done.excess)
        running.append(s.pop())
        s.push(Req("g"))
    return (time.perf_counter() - t0) / n * 1e6


def write_tree(target: Path) -> None:
    """This checkout's service, sandbox and models at HEAD, the queue swapped for FIFO."""
    target.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD", "service", "sandbox",
                              "models"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    for built in (ROOT / "sandbox").glob("_memguard*.so"):
        shutil.copy(built, target / "sandbox")
    shutil.copy(ROOT / "bench" / "fifo_scheduler.py", target / "sandbox" / "scheduler.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=300_000, help="requests per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", type=Path, help="write the FIFO copy of this checkout here")
    args = parser.parse_args()
    fair = load(ROOT / "sandbox" / "scheduler.py").Scheduler
    fifo = load(ROOT / "bench" / "fifo_scheduler.py").Scheduler
    rows: dict[str, list[float]] = {"fair": [], "fifo": []}
    for _ in range(args.rounds):
        rows["fair"].append(per_request_us(fair, args.n))
        rows["fifo"].append(per_request_us(fifo, args.n))
    for name, values in rows.items():
        print(f"{name:5} {min(values):5.2f} us per request (finish + pop + push; best of {args.rounds})")
    print(f"fair - fifo: {min(rows['fair']) - min(rows['fifo']):.2f} us per request")
    if args.tree is not None:
        write_tree(args.tree)
        print(f"FIFO tree written to {args.tree}: python bench/invoke_bench.py --before {args.tree}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
