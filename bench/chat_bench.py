"""Chat command benchmark: how far inside the platform's 3-second budget commands answer.

Starts a real `logic serve` (SQLite) with a chat public key, and sends, one
at a time and alternating, correctly signed PINGs (the baseline: signature
check and routing only) and `/logic script list`, `show` and `secret`
commands (signature, parse, the service layer on the chat threads, reply).
Prints p50/p99 per kind in milliseconds and each command's p50 as a ratio
of the PING's, measured in the same run.

    python bench/chat_bench.py [--rounds 200]
"""
from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nacl.signing import SigningKey  # noqa: E402

from tests.service.http.harness import LOGIC, Server  # noqa: E402

GUILD, OWNER = "424242424242", "111111111111111111"
_ids = itertools.count(10**17)


def interaction(kind: int, path: tuple[str, ...], options: dict[str, str]) -> dict[str, object]:
    leaf: list[object] = [{"type": 3, "name": k, "value": v} for k, v in options.items()]
    for i, name in reversed(list(enumerate(path))):
        leaf = [{"type": 2 if i < len(path) - 1 else 1, "name": name, "options": leaf}]
    return {"id": str(next(_ids)), "application_id": "1", "type": kind, "token": "t" * 60,
            "guild_id": GUILD, "member": {"user": {"id": OWNER}},
            "data": {"name": "logic", "options": leaf}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    key = SigningKey.generate()
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/bench.db"
        run = [LOGIC, "--database-url", url]
        subprocess.run(run + ["db", "upgrade"], check=True, capture_output=True)
        subprocess.run(run + ["guild", "create", GUILD, "--owner", OWNER, "--plan", "pro"],
                       check=True, capture_output=True)
        with open(f"{tmp}/s.py", "w") as fh:
            fh.write("on endpoint(event):\n    event.reply({'ok': True})\n")
        made = subprocess.run(run + ["script", "create", GUILD, "--name", "bench", "--file",
                                     f"{tmp}/s.py", "--json"], check=True, capture_output=True,
                              text=True)
        script_id = json.loads(made.stdout)["logicScriptId"]
        config = f"{tmp}/logic.toml"
        with open(config, "w") as fh:
            fh.write(f'[chat]\npublic_key = "{key.verify_key.encode().hex()}"\n')
        server = Server(url, config, extra_args=["--workers", "1"],
                        env={"LOGIC_SERVER_COOKIE_SECRET": "bench-cookie-secret-" + "x" * 32}).start()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            kinds = {
                "ping": lambda: {"type": 1},
                "list": lambda: interaction(2, ("script", "list"), {}),
                "show": lambda: interaction(2, ("script", "show"), {"script": script_id}),
                "secret": lambda: interaction(2, ("script", "secret"), {"script": script_id}),
            }
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for _ in range(args.rounds):
                for name, make in kinds.items():
                    body = json.dumps(make()).encode()
                    ts = str(int(time.time()))
                    sig = key.sign(ts.encode() + body).signature.hex()
                    start = time.perf_counter()
                    conn.request("POST", "/interactions", body=body, headers={
                        "X-Signature-Ed25519": sig, "X-Signature-Timestamp": ts,
                        "Content-Type": "application/json"})
                    resp = conn.getresponse()
                    data = resp.read()
                    times[name].append((time.perf_counter() - start) * 1000)
                    assert resp.status == 200 and json.loads(data)["type"] in (1, 4), data[:80]
        finally:
            server.stop()
    base = statistics.median(times["ping"])
    print(f"load average {os.getloadavg()[0]:.2f}; {args.rounds} rounds; milliseconds")
    for name, values in times.items():
        values.sort()
        p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
        print(f"{name:7s} p50 {statistics.median(values):7.2f}  p99 {p99:7.2f}  "
              f"p50/ping {statistics.median(values) / base:5.1f}x")


if __name__ == "__main__":
    main()
