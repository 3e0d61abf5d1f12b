"""Sandbox benchmark: the pool against in-process exec, and the cost of memory accounting.

Run: ``python bench/sandbox_bench.py`` (``--quick`` for a short run).

1. Throughput: invocations/s of a small JSON-validating script through
   ``Pool`` (``--concurrency`` requests in flight) against ``run_endpoint``
   on the same compiled script in this process, plus the ratio.
2. Latency: p50/p99 of one request at a time through the pool, and the p50
   overhead per invocation (pool p50 minus in-process p50).
3. Memory accounting: an allocation-heavy script run in-process with no
   accounting, with ``_memguard`` armed, and with tracemalloc.
4. Tenancy: invocations/s with the requests of 1, 10, 100 and 1,000 guilds
   interleaved round robin (each guild its own script), through a pool that
   shares workers between guilds (``guild_workers=False``, the behaviour
   before per-guild workers) and through the default pool (a worker never
   serves two guilds), in the same run, each cell in a fresh process of its
   own (a pool started after another in one process ran slower); plus the
   forks and retirements the default pool needed (``--guilds`` picks the
   counts), and the default pool's CPU per invocation: all processors' busy
   time (so run it on an otherwise idle machine), the service's share and
   the rest (workers, fork server, kernel threads).
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from typing import Any, Callable

if "--plain" not in sys.argv:  # --baseline's child imports the sandbox from PYTHONPATH
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from sandbox.compiler import compile_script  # noqa: E402
from sandbox.limits import MEMGUARD_AVAILABLE, GuardAccountant  # noqa: E402
from sandbox.pool import Limits, Pool, ScriptRef  # noqa: E402
from sandbox.runtime import run_endpoint  # noqa: E402

VALIDATE = '''import json

def valid(d):
    return isinstance(d, dict) and isinstance(d.get("score"), int) and isinstance(d.get("name"), str)

on endpoint(event):
    if not valid(event.body):
        event.status(422)
        event.reply({"error": "score must be an integer"})
        return
    event.reply({"ok": True, "double": event.body["score"] * 2, "name": event.body["name"]})
'''
ALLOCATE = '''on endpoint(event):
    n = event.body["n"]
    total = 0
    for i in range(n):
        row = {"id": i, "name": "item" + str(i), "tags": [i, i + 1, i + 2]}
        total += len(row["tags"])
    event.reply(total)
'''
BODY = {"score": 21, "name": "bench", "meta": {"source": "game-server", "region": "eu"},
        "items": [1, 2, 3, 4, 5]}


def make_event(body: Any) -> dict[str, Any]:
    return {"body": body, "rawBody": "", "headers": {"content-type": "application/json"},
            "query": {}, "method": "POST", "ip": "203.0.113.9", "userAgent": "bench",
            "timestamp": "2026-11-21T10:00:00.000Z"}


def per_call_us(fn: Callable[[], Any], n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return samples


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_in_process(n: int) -> tuple[float, float]:
    script = compile_script(VALIDATE).script
    assert script is not None
    event = make_event(BODY)
    assert run_endpoint(script, event)["body"].startswith(b'{"ok":true')
    t0 = time.perf_counter()
    for _ in range(n):
        run_endpoint(script, event)
    rate = n / (time.perf_counter() - t0)
    return rate, statistics.median(per_call_us(lambda: run_endpoint(script, event), 2000))


async def bench_pool(pool: Pool, n: int, concurrency: int) -> tuple[float, float, list[float]]:
    ref = ScriptRef("logic_bench", 1, VALIDATE)
    limits = Limits(time_ms=1000, memory_kb=512)
    event = make_event(BODY)
    first = await pool.run(ref, event, limits)
    assert first.error_kind is None, first
    remaining = n

    async def client() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            out = await pool.run(ref, event, limits)
            assert out.status == 200

    t0 = time.perf_counter()
    cpu0 = time.process_time()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    rate = n / (time.perf_counter() - t0)
    cpu_us = (time.process_time() - cpu0) / n * 1e6
    latencies = []
    for _ in range(min(n, 3000)):
        t1 = time.perf_counter()
        await pool.run(ref, event, limits)
        latencies.append((time.perf_counter() - t1) * 1e6)
    return rate, cpu_us, latencies


def busy_cpu_s() -> float:
    """CPU time all processors spent busy since boot (/proc/stat), in seconds."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


async def bench_guilds(pool: Pool, n: int, concurrency: int, guilds: int,
                       cpu: dict[str, float] | None = None) -> float:
    """Invocations/s with ``guilds`` guilds' requests interleaved round robin.

    ``cpu``, if given, gets the CPU per invocation of the measured part, in
    µs: ``all`` (every processor's busy time: assumes a machine otherwise
    idle) and ``service`` (this process: the pool's side)."""
    limits = Limits(time_ms=1000, memory_kb=512)
    event = make_event(BODY)
    refs = [ScriptRef(f"logic_bench_{g:05d}", 1, VALIDATE) for g in range(guilds)]
    for g in range(min(guilds, 256)):  # warm: every guild ran once (as far as workers go)
        args = (str(g),) if "guild" in inspect.signature(Pool.run).parameters else ()
        assert (await pool.run(refs[g], event, limits, *args)).status == 200
    counter = iter(range(n))
    # A pool from before the guild was part of the submission (--baseline).
    has_guild = "guild" in inspect.signature(Pool.run).parameters

    async def client() -> None:
        for i in counter:
            g = i % guilds
            if has_guild:
                out = await pool.run(refs[g], event, limits, str(g))
            else:
                out = await pool.run(refs[g], event, limits)
            assert out.status == 200, out

    busy0, own0, t0 = busy_cpu_s(), time.process_time(), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    if cpu is not None:
        cpu["all"] = (busy_cpu_s() - busy0) / n * 1e6
        cpu["service"] = (time.process_time() - own0) / n * 1e6
    return n / elapsed


def run_plain(counts: list[int], n: int, concurrency: int, workers: int) -> None:
    """The tenancy rows for whatever ``sandbox`` is on the path (--baseline's child)."""
    for g in counts:
        pool = Pool(size=workers)
        pool.start()

        async def go(pool: Pool = pool, g: int = g) -> float:
            try:
                return await bench_guilds(pool, n, concurrency, g)
            finally:
                await pool.stop()

        print(f"  {g:6d}  {asyncio.run(go()):9,.0f} inv/s", flush=True)


def run_cell(shared: bool, g: int, n: int, concurrency: int, workers: int) -> None:
    """One tenancy cell, in a process of its own (--cell): prints one JSON line."""
    pool = Pool(size=workers, **({"guild_workers": False} if shared else {}))  # type: ignore[arg-type]
    pool.start()
    cpu: dict[str, float] = {}

    async def go() -> tuple[float, dict[str, int], dict[str, float]]:
        try:
            rate = await bench_guilds(pool, n, concurrency, g, cpu)
            return rate, pool.counters, getattr(pool, "spawn_steps", {})
        finally:
            await pool.stop()

    rate, counters, steps = asyncio.run(go())
    print(json.dumps({"rate": rate, "counters": counters, "steps": steps, "cpu": cpu,
                      "max_workers": pool.max_workers}), flush=True)


def _cell(shared: bool, g: int, n: int, concurrency: int, workers: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--cell", "shared" if shared else "per-guild", "--guilds", str(g),
         "--n", str(n), "--concurrency", str(concurrency), "--workers", str(workers)],
        check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])  # type: ignore[no-any-return]


def run_tenancy(counts: list[int], n: int, concurrency: int, workers: int) -> None:
    """Section 4: the before/after table.

    Every cell runs in a fresh process of its own: a pool started after
    another one in the same process serves one guild 20-25 % slower (seen on
    an Intel host), which made every "of 1 guild" ratio of the later pool
    look better than it was."""
    print(f"tenancy: {n} invocations per cell, {concurrency} in flight, {workers} run slots, "
          "each cell in a process of its own")
    rows: dict[int, list[str]] = {g: [] for g in counts}
    base: dict[str, float] = {}
    spawn_steps: list[str] = []
    for label, shared in (("shared workers (before)", True), ("per-guild workers", False)):
        for g in counts:
            cell = _cell(shared, g, n, concurrency, workers)
            rate, counters, steps, cpu = cell["rate"], cell["counters"], cell["steps"], cell["cpu"]
            if not shared and steps.get("n"):
                spawn_steps.append(f"  {g:6d} guilds: {steps['n']:5.0f} workers started, mean ms: "
                                   + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()
                                               if k != "n"))
            base.setdefault(label, rate)
            rows[g].append(f"{rate:9,.0f} inv/s ({rate / base[label]:4.2f} of 1 guild)")
            if not shared:
                rows[g].append(f"workers {counters['workers']:4d}, retired {counters['retired']:6d}, "
                               f"max {cell['max_workers']}; CPU/inv {cpu['all']:4.0f} us "
                               f"(service {cpu['service']:3.0f}, workers {cpu['all'] - cpu['service']:3.0f})")
    print(f"  {'guilds':>6}  {'shared workers (before)':32}  {'per-guild workers (after)':32}")
    for g in counts:
        print(f"  {g:6d}  " + "  ".join(f"{c:32}" for c in rows[g]))
    first = counts[0]
    print(f"  after/before at {first} guild(s): see the two rates above "
          f"(target: within 10 %)")
    print("worker start-up (per-guild pools; fork_call: the fork server's fork(), fork: until "
          "the child runs, total: spawn request to ready):")
    print("\n".join(spawn_steps))


def _own_rate(guilds: int, n: int, concurrency: int, workers: int) -> float:
    """This tree's per-guild pool, in a fresh process (as the tenancy cells)."""
    return float(_cell(False, guilds, n, concurrency, workers)["rate"])


def run_paired(counts: list[int], n: int, args: argparse.Namespace, k: int) -> None:
    """Baseline and this tree alternately, K times per guild count: on a host
    whose speed drifts, each ratio compares two runs made seconds apart."""
    print(f"paired: {n} invocations per run, {args.concurrency} in flight, {args.workers} run "
          f"slots; baseline {args.baseline} (in a child) then this tree, {k} times")
    for g in counts:
        ratios = []
        for _ in range(k):
            out = subprocess.run(
                [sys.executable, __file__, "--plain", "--guilds", str(g), "--n", str(n),
                 "--concurrency", str(args.concurrency), "--workers", str(args.workers)],
                env={**os.environ, "PYTHONPATH": args.baseline}, check=True,
                capture_output=True, text=True).stdout
            before = float(out.split()[-2].replace(",", ""))
            after = _own_rate(g, n, args.concurrency, args.workers)
            ratios.append(after / before)
            print(f"  {g:6d} guilds: baseline {before:9,.0f} inv/s   this tree {after:9,.0f} "
                  f"inv/s   ratio {after / before:5.2f}", flush=True)
        print(f"  {g:6d} guilds: median ratio {statistics.median(ratios):.2f} over {k} pairs")


def bench_memory(n_rows: int, reps: int) -> dict[str, float]:
    script = compile_script(ALLOCATE).script
    assert script is not None
    event = make_event({"n": n_rows})

    def run() -> None:
        out = run_endpoint(script, event)
        assert out["error"] is None, out

    def timed(before: Callable[[], Any], after: Callable[[], Any]) -> float:
        samples = []
        for _ in range(reps):
            before()
            t0 = time.perf_counter()
            run()
            samples.append((time.perf_counter() - t0) * 1000)
            after()
        return statistics.median(samples)

    results = {"none": timed(lambda: None, lambda: None)}
    results["tracemalloc"] = timed(lambda: tracemalloc.start(1), tracemalloc.stop)
    if MEMGUARD_AVAILABLE:
        guard = GuardAccountant()  # installs the hooks for the rest of the process
        results["memguard_disarmed"] = timed(lambda: None, lambda: None)
        results["memguard_armed"] = timed(lambda: guard.arm(64 << 20), guard.disarm)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=30000, help="invocations per throughput run")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--spin-us", type=int, default=0, help="Pool(worker_spin_us=...)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--guilds", default="1,10,100,1000",
                        help="guild counts for the tenancy table ('' to skip it)")
    parser.add_argument("--tenancy-only", action="store_true")
    parser.add_argument("--baseline", metavar="DIR",
                        help="also run the tenancy rows with the sandbox package found in DIR "
                             "(e.g. `git archive main sandbox | tar -x -C DIR` plus the built "
                             "_memguard module), first, in a child process")
    parser.add_argument("--paired", type=int, default=0, metavar="K",
                        help="with --baseline: K alternating runs per guild count, the "
                             "baseline's pool then this tree's per-guild pool, and the median "
                             "of the K ratios (instead of the tables)")
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cell", choices=("shared", "per-guild"),
                        help="only one tenancy cell (the first of --guilds), printed as JSON")
    args = parser.parse_args()
    n = 3000 if args.quick else args.n
    counts = [int(c) for c in args.guilds.split(",") if c.strip()]
    if args.cell:
        run_cell(args.cell == "shared", counts[0], n, args.concurrency, args.workers)
        return
    if args.plain:
        run_plain(counts, n, args.concurrency, args.workers)
        return
    if args.baseline and args.paired:
        run_paired(counts, n, args, args.paired)
        return
    if args.baseline:
        print(f"tenancy with the sandbox package of {args.baseline} (baseline):", flush=True)
        subprocess.run([sys.executable, __file__, "--plain", "--guilds", args.guilds, "--n", str(n),
                        "--concurrency", str(args.concurrency), "--workers", str(args.workers)],
                       env={**os.environ, "PYTHONPATH": args.baseline}, check=True)
    if args.tenancy_only:
        run_tenancy(counts, n, args.concurrency, args.workers)
        return

    pool = Pool(size=args.workers, worker_spin_us=args.spin_us)  # before any loop or thread, as the service does
    pool.start()
    print(f"cpus={os.cpu_count()} workers={args.workers} concurrency={args.concurrency} "
          f"python={sys.version.split()[0]} hardening={sorted(k for k, v in pool.hardening.items() if v)}")

    async def run_pool() -> tuple[float, float, list[float]]:
        try:
            return await bench_pool(pool, n, args.concurrency)
        finally:
            await pool.stop()

    pool_rate, parent_cpu_us, latencies = asyncio.run(run_pool())
    inproc_rate, inproc_p50 = bench_in_process(n)
    p50 = pct(latencies, 0.5)
    print(f"in-process exec      : {inproc_rate:10,.0f} inv/s   p50 {inproc_p50:7.1f} us")
    print(f"through the pool     : {pool_rate:10,.0f} inv/s   p50 {p50:7.1f} us   "
          f"p99 {pct(latencies, 0.99):7.1f} us (one at a time)")
    print(f"ratio pool/in-process: {pool_rate / inproc_rate:10.3f}")
    print(f"parent (service) CPU per invocation through the pool: {parent_cpu_us:.1f} us")
    print(f"p50 overhead per invocation: {p50 - inproc_p50:.1f} us (latency, one at a time)")
    print(f"added cost per invocation at saturation: "
          f"{1e6 / pool_rate - 1e6 / inproc_rate:.1f} us (from the two rates)")

    if counts:
        run_tenancy(counts, n, args.concurrency, args.workers)

    mem = bench_memory(2000 if args.quick else 20000, 5 if args.quick else 15)
    base = mem["none"]
    print("memory accounting, allocation-heavy script (median ms per run):")
    for name, value in mem.items():
        print(f"  {name:18s} {value:8.2f} ms   x{value / base:5.2f}")


if __name__ == "__main__":
    main()
