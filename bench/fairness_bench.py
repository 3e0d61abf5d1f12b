"""Fairness between guilds: a victim guild's service with and without an attacker, in one run.

A real `logic serve` with the default worker count of this host (2 on the
2-core target). The victim guild calls an ordinary endpoint at a steady rate;
the attacker guild (pro plan, 9 endpoints) calls each of its endpoints at its
full quota (120 a minute), every call holding a worker for the 1 s time
limit (``--attack loop``), sitting in one long C-level operation
(``c-level``) or crashing its worker (``crash``).

    python bench/fairness_bench.py [--seconds 20] [--rate 50] [--attack loop,c-level,crash]

Prints, per attack: the victim's success rate and p50/p99 without the
attacker, then with it, and how the attacker's calls were answered.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.invoke_setup import (BENCH_PLAN, LOGIC, SERVE_ENV, free_port, logic,  # noqa: E402
                                wait_listening)

VICTIM = """
on endpoint(event):
    body = event.body
    if not isinstance(body, dict) or not isinstance(body.get("score"), int):
        event.status(422)
        event.reply({"error": "score must be an integer"})
        return
    event.reply({"ok": True, "double": body["score"] * 2})
"""
ATTACKS = {
    "loop": "on endpoint(event):\n    while True:\n        pass\n",
    "c-level": "import re\non endpoint(event):\n    re.match('(a+)+$', 'a' * 64 + 'b')\n",
    # 100,000 nested maps overflow the C stack (~14 MB: the pro plan gets 16 MB
    # here, PLAN_FOR_CRASH); scripts' chain over itself no longer crashes.
    "crash": "on endpoint(event):\n    m = iter([1])\n    for i in range(100000):\n"
             "        m = map(abs, m)\n    event.reply(list(m))\n",
}
PLAN_FOR_CRASH = "\n[plans.pro]\nmemory_kb = 16384\n"


async def post(port: int, path: str, secret: str) -> tuple[int, float]:
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        data = b'{"score": 21}'
        writer.write((f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {secret}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                      "Connection: close\r\n\r\n").encode() + data)
        await writer.drain()
        raw = await reader.read()
        writer.close()
        return int(raw.split(b" ", 2)[1]), time.perf_counter() - t0
    except (OSError, IndexError, ValueError):
        return 0, time.perf_counter() - t0


async def steady(port: int, path: str, secret: str, rate: float, seconds: float
                 ) -> list[tuple[int, float]]:
    tasks = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tasks.append(asyncio.ensure_future(post(port, path, secret)))
        await asyncio.sleep(1.0 / rate)
    return list(await asyncio.gather(*tasks))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def report(label: str, results: list[tuple[int, float]]) -> None:
    ok = [t for s, t in results if s == 200]
    print(f"  victim {label:<15} {len(ok):5d}/{len(results):<5d} 200 "
          f"({100.0 * len(ok) / max(1, len(results)):5.1f} %)   "
          f"p50 {1000 * pct([t for _, t in results], 0.5):7.1f} ms   "
          f"p99 {1000 * pct([t for _, t in results], 0.99):7.1f} ms", flush=True)


def setup(db: str, cfg: str, tmp: Path, guild: str, plan: str, source: str, n: int
          ) -> list[tuple[str, str]]:
    logic(db, cfg, "guild", "create", guild, "--owner", "42", "--plan", plan)
    (tmp / f"{guild}.py").write_text(source)
    out = []
    for i in range(n):
        sid = str(logic(db, cfg, "script", "create", guild, "--name", f"s{i}",
                        "--file", str(tmp / f"{guild}.py"))["logicScriptId"])
        logic(db, cfg, "endpoint", "enable", guild, sid)
        secret = str(logic(db, cfg, "secret", "regenerate", guild, sid, "--as", "42")["secret"])
        out.append((f"/endpoints/{guild}/{sid}", secret))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="per phase")
    parser.add_argument("--rate", type=float, default=50.0, help="victim requests per second")
    parser.add_argument("--attack", default="loop,c-level,crash")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="logic-fair-"))
    db = f"sqlite:///{tmp / 'fair.db'}"
    cfg = tmp / "fair.toml"
    cfg.write_text(BENCH_PLAN + (PLAN_FOR_CRASH if "crash" in args.attack.split(",") else ""))
    logic(db, str(cfg), "db", "upgrade")
    victim = setup(db, str(cfg), tmp, "2000", "bench", VICTIM, 1)[0]
    attackers = {name: setup(db, str(cfg), tmp, str(3000 + i), "pro", ATTACKS[name], 9)
                 for i, name in enumerate(args.attack.split(","))}
    port = free_port()
    proc = subprocess.Popen([LOGIC, "--database-url", db, "--config", str(cfg), "serve",
                             "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**SERVE_ENV, **os.environ})
    try:
        wait_listening(proc)
        print(f"victim at {args.rate:.0f}/s, attacker 9 endpoints x 2/s, "
              f"{args.seconds:.0f} s per phase, default workers")

        async def run() -> None:
            for _ in range(20):
                await post(port, *victim)
            for name, eps in attackers.items():
                print(f"attack: {name}")
                report("alone", await steady(port, *victim, args.rate, args.seconds))
                attack = asyncio.gather(*[steady(port, path, secret, 2.0, args.seconds + 2)
                                          for path, secret in eps])
                await asyncio.sleep(2.0)  # the attack is in full swing
                report("under attack", await steady(port, *victim, args.rate, args.seconds))
                statuses = Counter(s for rs in await attack for s, _ in rs)
                print(f"  attacker answered: {dict(sorted(statuses.items()))}", flush=True)

        asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
