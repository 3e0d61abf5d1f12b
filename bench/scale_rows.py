"""The rows of `scale_bench.py`: which endpoints each calls, in what order, and
the wrk runs that walk a row's sequence (`Rotation`).

The database `scale_bench.py` fills: guilds 1..100 hold 100 scripts each
(10,000 scripts), guilds 100001.. one script each (90,000), every endpoint
sharing SECRET.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from invoke_setup import BODY, run_wrk

SECRET = "lsk_" + "s" * 43
BIG_GUILDS = 100          # guilds 1..100, SCRIPTS_PER_BIG scripts each
SCRIPTS_PER_BIG = 100
SMALL_FIRST = 100_001     # guilds 100001..: one script each
SMALL_GUILDS = 90_000

ROTATE_LUA = """
paths = {{{paths}}}
n = #paths
i = 0
init = function(args)
    i = (tonumber(args[1]) or 0) % n
end
body = {body}
headers = {{["Content-Type"] = "application/json", ["Authorization"] = "Bearer {secret}"}}
request = function()
    i = i + 1
    if i > n then i = 1 end
    return wrk.format("POST", paths[i], headers, body)
end
"""


def script_id(n: int) -> str:
    return f"logic_s{n:021d}"


def big_path(g: int, k: int) -> str:
    """Script k (0..99) of big guild g (1..100)."""
    return f"/endpoints/{g}/{script_id((g - 1) * SCRIPTS_PER_BIG + k + 1)}"


def small_path(i: int) -> str:
    """The one script of small guild i (0-based)."""
    return f"/endpoints/{SMALL_FIRST + i}/{script_id(BIG_GUILDS * SCRIPTS_PER_BIG + i + 1)}"


def zipf_paths(guilds: int, s: float, count: int, seed: int = 7) -> list[str]:
    weights = [1.0 / (r ** s) for r in range(1, guilds + 1)]
    rng = random.Random(seed)
    picks = rng.choices(range(guilds), weights=weights, k=count)
    return [small_path(i) for i in picks]


def rows() -> list[tuple[str, list[str], list[str]]]:
    """(label, the row's distinct endpoints, the request sequence wrk rotates over)."""
    one = [big_path(1, 0)]
    s100 = [big_path(g, 0) for g in range(1, 101)]
    s1000 = [big_path(g, k) for k in range(10) for g in range(1, 101)]
    s10000 = [big_path(g, k) for k in range(100) for g in range(1, 101)]
    g1000 = [small_path(i) for i in range(1000)]
    zipf = zipf_paths(10_000, 1.1, 100_000)
    return [("1 endpoint", one, one), ("100 scripts / 100 guilds", s100, s100),
            ("1,000 scripts / 100 guilds", s1000, s1000),
            ("10,000 scripts / 100 guilds", s10000, s10000),
            ("1,000 guilds round robin", g1000, g1000),
            ("10,000 guilds Zipf(1.1)", sorted(set(zipf)), zipf)]


def lua_file(tmp: Path, name: str, paths: list[str]) -> str:
    f = tmp / f"{name}.lua"
    f.write_text(ROTATE_LUA.format(paths=",".join(json.dumps(p) for p in paths),
                                   body=json.dumps(BODY), secret=SECRET))
    return str(f)


class Rotation:
    """A row's request sequence, each wrk run going on where the one before
    stopped (a run that started from the first path again would call the same
    prefix of a long sequence every time: a warm-up would never reach the rest,
    and a measured run would replay what the warm-up just called)."""

    def __init__(self, tmp: Path, name: str, paths: list[str]) -> None:
        self.lua = lua_file(tmp, name, paths)
        self.size = len(paths)
        self.at = 0   # requests issued so far, less those still in flight when a run ended

    def run(self, url: str, connections: int, seconds: int) -> dict[str, float]:
        r = run_wrk(url, self.lua, connections, seconds, (str(self.at % self.size),))
        self.at += int(r["total"])
        return r
