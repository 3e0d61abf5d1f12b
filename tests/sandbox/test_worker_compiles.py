"""Code a worker compiled for its own job is offered to the code cache of its
guild only (sandbox.compiling), with real workers.

When no compile worker is at hand, the request's own worker compiles the
source. A worker that has never run a script has seen nothing but compiler
input and is bound to the request's guild for life, as a compile worker bound
to that guild: its "compiled" message (sent before the script runs) offers the
marshalled code; the guild's next workers load it instead of compiling, and no
compile worker is spent on the version later. A worker that has run a script
never offers code.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from typing import Any

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


def _compiled(**extra: object) -> dict[str, object]:
    return {"t": "compiled", "id": 1, **extra}


def test_offered_code_must_be_well_formed() -> None:
    meta = {"events": ["endpoint"], "endpoint": True, "gen": False, "err": None}
    check_reply(_compiled())
    check_reply(_compiled(code=b"\xe3" * 10, meta=meta))
    for bad in (_compiled(code=b"\xe3"),                                  # no meta
                _compiled(meta=meta),                                     # no code
                _compiled(code="text", meta=meta),
                _compiled(code=b"", meta=meta),
                _compiled(code=b"x" * (MAX_SHIPPED_CODE + 1), meta=meta),
                _compiled(code=b"x", meta={**meta, "err": [1, "no"]}),  # an error is not code
                _compiled(code=b"x", meta={**meta, "extra": 1})):
        with pytest.raises(ProtocolError):
            check_reply(bad)


# --- a compromised worker's reports (the message handling driven directly, as R10) ---------

@contextlib.contextmanager
def _driven_pool() -> Iterator[tuple[Pool, Any, Any]]:
    """A never-started pool whose message handling the test drives, with one
    worker handle holding job 7; a real process of ours stands for the worker,
    so a kill hits nobody else. Yields (pool, loop, worker handle)."""
    import socket
    import subprocess

    from sandbox.channel import RequestState, WorkerHandle

    child = subprocess.Popen(["sleep", "30"])
    pool = Pool(size=1)
    loop = asyncio.new_event_loop()
    pool._loop = loop
    pool._state = "stopping"   # nothing is respawned
    ours, theirs = socket.socketpair()
    w = WorkerHandle(0, child.pid, ours.detach(), -1, cache_size=4, max_jobs=100, now=0.0)
    w.ready = True
    pool._workers[0] = w
    req = RequestState(loop.create_future(), "job", ref(REPLY % 1), event(), LIMITS)
    req.id = 7
    req.seated = False
    w.req = req
    pool._busy = 1
    try:
        yield pool, loop, w
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        w.close(None)
        theirs.close()
        loop.close()


def test_only_a_worker_that_never_ran_a_script_may_offer_code() -> None:
    """Offered code is accepted only with the "compiled" of a job whose source the
    worker was sent, and only from a worker that has never run a script (one that
    ran one may have been taken over by it: its code would outlive it)."""
    meta = {"events": ["endpoint"], "endpoint": True, "gen": False, "err": None}
    offer = {"t": "compiled", "id": 7, "code": b"\xe3" * 10, "meta": meta}
    # (jobs done, source sent, asked for it again, offered before, accepted)
    for jobs_done, source_sent, asked, offered, accepted in (
            (0, True, False, False, True), (1, True, False, False, False),
            (0, False, False, False, False), (0, True, True, False, True),
            (0, True, False, True, False)):
        with _driven_pool() as (pool, loop, w):
            w.jobs = jobs_done
            w.offered = offered
            w.req.ships_source = source_sent
            w.req.asked_source = asked
            codes = pool._codes
            assert codes is not None
            if accepted:
                pool._on_message(w, dict(offer))
                assert len(codes) == 1 and pool.counters["worker_compiles"] == 1
            else:
                with pytest.raises(ProtocolError):
                    pool._on_message(w, dict(offer))
                assert len(codes) == 0


def test_a_worker_reporting_growth_past_its_own_bound_is_replaced() -> None:
    """A worker retires itself past MAX_RSS_GROWTH_BYTES; one that reports more and
    stays is replaced, so what it is charged against the memory budget (and so what
    it can make the pool retire of other guilds' workers) stays bounded."""

    from sandbox.channel import RequestState
    from sandbox.limits import MAX_RSS_GROWTH_BYTES
    from sandbox.budget import WORKER_BYTES

    # The stated bound, written out (docs/security.md, docs/security-workers.md:
    # 64 MiB above its start-up size), not read from the constant.
    bound = 64 << 20
    with _driven_pool() as (pool, loop, w):
        pool._on_message(w, {**_res(rss=20 << 20), "id": 7})      # honest: stays
        assert w.alive and pool.memory_estimate() == WORKER_BYTES

        def job(n: int, rss: int) -> None:
            req = RequestState(loop.create_future(), "job", ref(REPLY % 1), event(), LIMITS)
            req.id = n
            w.req = req
            pool._busy = 1
            pool._on_message(w, {**_res(rss=rss), "id": n})

        job(8, (20 << 20) + bound)            # at the bound: an honest worker may stay
        assert w.alive
        job(9, (20 << 20) + bound + 4096)
        assert not w.alive                    # replaced, its charge gone with it
        assert os.waitpid(w.pid, 0)[1] == signal.SIGKILL
        assert pool.memory_estimate() <= WORKER_BYTES
    assert MAX_RSS_GROWTH_BYTES == bound      # what a worker retires itself past too


def test_need_for_a_job_that_carried_its_script_is_a_protocol_error() -> None:
    """A job sent with the cached code (or the source) needs nothing: the worker
    runs it without a "compiled" first, so a "need" after it may come from a
    worker the script took over. Answered, the source would go out again (once
    the code cache had dropped the entry) and that worker, with no job done yet,
    could offer its own code for the guild's later workers (review, session 25)."""
    import marshal

    from sandbox.codecache import source_digest

    with _driven_pool() as (pool, loop, w):
        req, codes = w.req, pool._codes
        assert codes is not None
        req.dig = source_digest(req.ref.key, req.ref.version, req.ref.source)
        codes.put((req.guild, req.ref.key, req.ref.version, req.dig),
                  marshal.dumps(compile("1", "s", "exec")), ("endpoint",), True, False, None)
        w.job_frame(req, codes)
        assert req.sent_script and not req.ships_source
        with pytest.raises(ProtocolError):
            pool._on_message(w, {"t": "need", "id": 7})
    with _driven_pool() as (pool, loop, w):   # the frame went without it: asked once
        req = w.req
        w.known[(req.ref.key, req.ref.version, req.dig)] = None
        w.job_frame(req, pool._codes)
        assert not req.sent_script
        pool._on_message(w, {"t": "need", "id": 7})
        assert req.asked_source and req.sent_script


def test_need_after_compiled_is_a_protocol_error() -> None:
    """After "compiled" the script may have run: a "need" then would re-ship the
    source (a second compile budget, a second chance to offer code)."""
    with _driven_pool() as (pool, loop, w):
        w.req.ships_source = True
        pool._on_message(w, {"t": "compiled", "id": 7})
        deadline = w.req.deadline
        with pytest.raises(ProtocolError):
            pool._on_message(w, {"t": "need", "id": 7})
        assert w.req.deadline == deadline


def test_a_worker_whose_first_job_did_not_compile_offers_nothing_later() -> None:
    """Offers end with a worker's first job, whatever it was (the service counts
    jobs, not scripts run): a worker whose first source failed to compile
    compiles the next one without offering it, and is not taken for a liar."""
    async def scenario(pool: Pool) -> None:
        big = asyncio.ensure_future(pool.run(ref(BIG, "logic_big"), event(), LIMITS, "z"))
        compiler = pool._compiler
        assert compiler is not None
        await wait_for(lambda: compiler.req is not None)
        broken = await pool.run(ref("on endpoint(event):\n    event.reply(\n", "logic_e1"),
                                event(), LIMITS, "e")
        assert broken.error_kind == "script_error"
        (worker,) = pool._guild_idle["e"]
        good = await pool.run(ref(REPLY % "ok", "logic_e2"), event(), LIMITS, "e")
        assert good.status == 200 and good.body == b'{"v":"ok"}'
        assert worker.alive and pool._guild_idle["e"] == [worker]   # not replaced
        assert pool.counters["crashes"] == 0 and pool.counters["worker_compiles"] == 0
        await big

    run_with_pool(scenario, size=2, max_workers=8)
