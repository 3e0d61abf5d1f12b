"""Code a worker compiled for its own job is offered to the code cache of its
guild only (sandbox.compiling), with real workers.

When no compile worker is at hand, the request's own worker compiles the
source (it is bound to the request's guild for life, as a compile worker is
bound to the guild it compiles for) and its reply offers the marshalled code;
the guild's next workers load it instead of compiling, and no compile worker
is spent on the version later.
"""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from sandbox.codecache import source_digest
from sandbox.errors import ProtocolError
from sandbox.pool import Pool
from sandbox.protocol import MAX_SHIPPED_CODE, check_reply

from tests.sandbox.poolkit import LIMITS, event, ref, run_with_pool, wait_for

pytestmark = pytest.mark.timeout(90)

REPLY = "on endpoint(event):\n    event.reply({'v': %r})\n"
# Slow to compile (~0.3-1 s): it keeps the compile worker busy.
BIG = "\n".join(["on endpoint(event):", "    t = 0"]
                + [f"    t = t + {i} * 2 - (t // 3)" for i in range(7000)]
                + ["    event.reply(t)"]) + "\n"


def test_a_workers_own_compile_feeds_its_guilds_cache_and_no_other() -> None:
    src = REPLY % "x"

    async def scenario(pool: Pool) -> None:
        # The compile worker is busy with guild Z's long source, so A's request
        # does not wait for it: A's own worker compiles A's source.
        big = asyncio.ensure_future(pool.run(ref(BIG, "logic_big"), event(), LIMITS, "z"))
        compiler = pool._compiler
        assert compiler is not None
        await wait_for(lambda: compiler.req is not None)
        out = await pool.run(ref(src, "logic_w"), event(), LIMITS, "a")
        assert out.status == 200 and out.body == b'{"v":"x"}'
        assert compiler.req is not None       # Z's compile was still running
        assert pool.counters["worker_compiles"] == 1
        codes = pool._codes
        assert codes is not None
        key_a = ("a", "logic_w", 1, source_digest("logic_w", 1, src))
        assert key_a in codes
        assert all(item[0] != key_a for item in pool._compile_q)   # no compile worker for it
        await big
        assert pool._compiler_guild == "z"    # the compile worker never saw A's source
        # A's next worker loads that code: no compile anywhere.
        (worker,) = pool._guild_idle["a"]
        os.kill(worker.pid, signal.SIGKILL)
        await wait_for(lambda: not worker.alive)
        compiles = pool.counters["compiles"]
        again = await pool.run(ref(src, "logic_w"), event(), LIMITS, "a")
        assert again.status == 200 and again.body == b'{"v":"x"}'
        assert pool.counters["worker_compiles"] == 1 and pool.counters["compiles"] == compiles
        # Another guild, same script key, version and source: never A's code
        # (its own compile, by its worker or a compile worker of its own).
        other = await pool.run(ref(src, "logic_w"), event(), LIMITS, "b")
        assert other.status == 200
        assert pool.counters["worker_compiles"] + pool.counters["compiles"] == compiles + 2
        assert ("b",) + key_a[1:] in codes and key_a in codes

    run_with_pool(scenario, size=2, max_workers=8)


def _res(**extra: object) -> dict[str, object]:
    result = {"replied": True, "status": 200, "headers": [], "body": b"{}",
              "contentType": "application/json", "output": "", "error": None}
    return {"t": "res", "id": 1, "r": result, "peak": 0, "over": False, "dur": 0.1,
            "exit": False, "rss": 1 << 20, **extra}


def test_offered_code_must_be_well_formed() -> None:
    meta = {"events": ["endpoint"], "endpoint": True, "gen": False, "err": None}
    check_reply(_res())
    check_reply(_res(code=b"\xe3" * 10, meta=meta))
    for bad in (_res(code=b"\xe3"),                                  # no meta
                _res(meta=meta),                                     # no code
                _res(code="text", meta=meta),
                _res(code=b"", meta=meta),
                _res(code=b"x" * (MAX_SHIPPED_CODE + 1), meta=meta),
                _res(code=b"x", meta={**meta, "err": [1, "no"]}),  # an error is not code
                _res(code=b"x", meta={**meta, "extra": 1})):
        with pytest.raises(ProtocolError):
            check_reply(bad)
