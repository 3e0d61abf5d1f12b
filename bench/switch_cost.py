"""What a guild switch costs: every invocation retires a worker and starts one.

A per-guild pool capped at `--max-workers` (24) serves `--guilds` (400)
guilds round robin, 16 invocations in flight, so past its warm-up every
invocation finds no worker of its guild and retires the least recently used
one for a new process (docs/performance.md, "A guild switch"). Prints, per
switch (per retired worker), over `--n` measured invocations:

- `busy`: every processor's busy time (/proc/stat; run it on an otherwise
  idle machine),
- `workers`: the CPU time of the workers that exited (the fork server's
  reaped children: user + system, clock ticks) and their page faults
  (minor faults: mostly copy-on-write copies of the fork server's pages),
- `fork server`: its own CPU time and page faults (its pages turn
  copy-on-write at every fork, so its next writes copy them),
- the pool's mean start-up steps of a worker (`Pool.spawn_steps`: the fork
  server's `fork()`, until the child runs, hardening, init; wall time).

Page-fault counts are nearly the same from run to run; times move with the
host's load.

    python bench/switch_cost.py [--guilds 400] [--n 1500] [--max-workers 24]

`PYTHONPATH=DIR python bench/switch_cost.py` measures the `sandbox` package
in DIR (another tree: `git archive REV sandbox | tar -x -C DIR` plus its
built `_memguard`), fork server included: it is exec'd with this process's
`sys.path`.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
OTHER = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
sys.path[:0] = OTHER + [os.path.dirname(HERE), HERE]
from sandbox.pool import Limits, Pool, ScriptRef  # noqa: E402  (from PYTHONPATH's tree first)
from sandbox_bench import BODY, VALIDATE, busy_cpu_s, make_event  # noqa: E402
# sandbox_bench puts this tree first; the fork server imports by sys.path.
sys.path[:0] = OTHER


def proc_times(pid: int) -> dict[str, int]:
    """Fault and CPU counters of `pid` and of its reaped children (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[0] is proc(5)'s field 3 (state): minflt is field 10, cminflt 11,
    # utime 14, stime 15, cutime 16, cstime 17.
    return {"minflt": int(fields[7]), "cminflt": int(fields[8]), "utime": int(fields[11]),
            "stime": int(fields[12]), "cutime": int(fields[13]), "cstime": int(fields[14])}


async def measure(pool: Pool, guilds: int, n: int) -> dict[str, Any]:
    limits = Limits(time_ms=1000, memory_kb=512)
    event = make_event(BODY)
    refs = [ScriptRef(f"logic_switch_{g:05d}", 1, VALIDATE) for g in range(guilds)]
    for g in range(60):     # fill the pool to its cap
        assert (await pool.run(refs[g], event, limits, str(g))).status == 200
    before = proc_times(pool._zygote_pid)
    busy0, retired0, t0 = busy_cpu_s(), pool.counters["retired"], time.perf_counter()
    counter = iter(range(60, 60 + n))

    async def client() -> None:
        for i in counter:
            out = await pool.run(refs[i % guilds], event, limits, str(i % guilds))
            assert out.status == 200, out

    await asyncio.gather(*(client() for _ in range(16)))
    elapsed = time.perf_counter() - t0
    after = proc_times(pool._zygote_pid)
    switches = pool.counters["retired"] - retired0
    ms = 1000.0 / os.sysconf("SC_CLK_TCK") / max(switches, 1)
    return {
        "rate": n / elapsed, "switches": switches,
        "busy_ms": (busy_cpu_s() - busy0) * 1000.0 / max(switches, 1),
        "workers_ms": (after["cutime"] + after["cstime"] - before["cutime"] - before["cstime"]) * ms,
        "workers_sys_ms": (after["cstime"] - before["cstime"]) * ms,
        "workers_faults": (after["cminflt"] - before["cminflt"]) / max(switches, 1),
        "server_ms": (after["utime"] + after["stime"] - before["utime"] - before["stime"]) * ms,
        "server_faults": (after["minflt"] - before["minflt"]) / max(switches, 1),
        "steps": pool.spawn_steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--guilds", type=int, default=400)
    parser.add_argument("--n", type=int, default=1500, help="measured invocations")
    parser.add_argument("--max-workers", type=int, default=24)
    args = parser.parse_args()
    if args.guilds <= args.max_workers + 16:
        sys.exit("switch_cost: --guilds must exceed --max-workers + 16 (else workers are reused)")
    pool = Pool(size=2, max_workers=args.max_workers, spares=2)
    pool.start()

    async def go() -> dict[str, Any]:
        try:
            return await measure(pool, args.guilds, args.n)
        finally:
            await pool.stop()

    r = asyncio.run(go())
    steps = r["steps"]
    print(f"{r['switches']} switches, {r['rate']:.0f} invocations/s; per switch:")
    print(f"  busy (all processors)  {r['busy_ms']:6.2f} ms")
    print(f"  workers                {r['workers_ms']:6.2f} ms CPU ({r['workers_sys_ms']:.2f} ms "
          f"system), {r['workers_faults']:5.0f} page faults")
    print(f"  fork server            {r['server_ms']:6.2f} ms CPU, {r['server_faults']:5.0f} page faults")
    print("  start-up steps (mean wall ms): " + ", ".join(
        f"{k} {v:.2f}" for k, v in steps.items() if k != "n"))


if __name__ == "__main__":
    main()
