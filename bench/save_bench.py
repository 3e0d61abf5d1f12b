"""What a script save's compile costs: the compile server against a fresh interpreter.

Every save compiles its source once in a sandboxed process
(`sandbox.compile_gate`). Alternating, in one run, this times
`compile_gate.check_source` on distinct sources (a new guild each, so no
remembered verdict) through the compile server, and the way saves were
compiled before it: a fresh `python -I` interpreter per save that imports
the compiler, hardens itself and compiles the same way (`--fresh`). It
prints the median wall time and the CPU time (service and compile processes)
per save, for a small script and a ~250 KB one.
Usage: python bench/save_bench.py [--saves N]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandbox import compile_gate, limits  # noqa: E402

SMALL = "on endpoint(event):\n    event.reply({{'n': {n}}})\n"
BLOCK = ("def handler_{i}(event, data):\n    total = 0\n"
         "    for item in data.get('items', []):\n"
         "        total += item['price'] * item.get('qty', 1) + {n}\n"
         "    return {{'total': total, 'name': 'handler_{i}'}}\n\n")

# The compile process as it was before the server: a new interpreter per save.
FRESH = (
    "import json, sys\n"
    "params = json.loads(sys.argv[1])\n"
    "sys.path[:] = params['path']\n"
    "from sandbox import compile_gate\n"
    "compile_gate.compile_child(params)\n"
)


def _cpu() -> float:
    """CPU seconds of this process, its children, and the compile server's
    children (reaped by the server, so not counted as ours while it runs)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    proc = compile_gate._server._proc
    if proc is not None:
        with open(f"/proc/{proc.pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        total += sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def _fresh(text: str) -> None:
    params = {"cpu": limits.COMPILE_CPU_BUDGET_S, "mem": limits.COMPILE_MEMORY_BYTES,
              "uid": 65534, "gid": 65534, "nice": 0, "wall": 30.0,
              "path": [p for p in sys.path if isinstance(p, str)]}
    out = subprocess.run([sys.executable, "-I", "-c", FRESH, json.dumps(params)],
                         input=text.encode(), capture_output=True, env={}, check=True)
    assert json.loads(out.stdout)["errors"] == []


def _server(text: str) -> None:
    assert compile_gate.check_source(text, scope=f"bench-{time.monotonic_ns()}").ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=20)
    args = parser.parse_args()
    _server(SMALL.format(n=-1))   # the server's start is once per service process
    sizes = {"small": lambda n: SMALL.format(n=n),
             "250 KB": lambda n: "".join(BLOCK.format(i=i, n=n) for i in range(1200))
             + SMALL.format(n=n)}
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for n in range(args.saves):
        for size, make in sizes.items():
            for way, run in (("compile server", _server), ("fresh interpreter", _fresh)):
                text = make(n)
                c0, t0 = _cpu(), time.perf_counter()
                run(text)
                results.setdefault((size, way), []).append(
                    (time.perf_counter() - t0, _cpu() - c0))
    print(f"{'source':8} {'compile by':18} {'wall ms':>8} {'CPU ms':>8}   ({args.saves} saves, "
          f"medians; pid {os.getpid()})")
    for (size, way), samples in results.items():
        wall = statistics.median(s[0] for s in samples) * 1000
        cpu = statistics.median(s[1] for s in samples) * 1000
        print(f"{size:8} {way:18} {wall:8.1f} {cpu:8.1f}")


if __name__ == "__main__":
    main()
