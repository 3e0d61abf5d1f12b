"""Start-up time of the `logic` command, against the bare interpreter in the same run.

Runs, alternating so machine load hits all alike, `python -c pass` (the
baseline), `python -c "import click"` (the CLI library alone), `logic --help`,
a usage error (`logic history`), `logic script check FILE` (loads the
compiler, no database) and `logic script list` on a fresh SQLite database;
prints the median wall time of each and its excess over the baseline.
The target (issue 17): `logic --help` under 300 ms.
Usage: python bench/cli_startup.py [RUNS]
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOGIC = str(Path(sys.executable).with_name("logic"))


def main(runs: int) -> None:
    tmp = Path(tempfile.mkdtemp())
    script = tmp / "s.py"
    script.write_text("on endpoint(event):\n    event.reply({'ok': True})\n")
    db = f"sqlite:///{tmp}/b.db"
    subprocess.run([LOGIC, "--database-url", db, "db", "upgrade"], check=True, capture_output=True)
    subprocess.run([LOGIC, "--database-url", db, "guild", "create", "1", "--owner", "2"],
                   check=True, capture_output=True)
    cases = {
        "python -c pass (baseline)": [sys.executable, "-c", "pass"],
        "python -c 'import click'": [sys.executable, "-c", "import click"],
        "logic --help": [LOGIC, "--help"],
        "logic history (usage error)": [LOGIC, "history"],
        "logic script check FILE": [LOGIC, "script", "check", str(script)],
        "logic script list (SQLite)": [LOGIC, "--database-url", db, "script", "list", "1"],
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, argv in cases.items():
            start = time.perf_counter()
            subprocess.run(argv, capture_output=True)
            times[name].append((time.perf_counter() - start) * 1000)
    base = statistics.median(times["python -c pass (baseline)"])
    print(f"{'case':32} {'median ms':>10} {'over baseline':>14}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:32} {median:10.1f} {median - base:14.1f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
