"""Compiled code shipped to workers (sandbox.codecache, sandbox.compiling), with real workers.

A version is compiled once per guild, by a compile worker bound to that guild;
the guild's workers load its marshalled code. Cached code is bound to (guild,
script key, version, source digest) and to a MAC: a changed entry, a changed
source or another guild's code is never run.
"""
from __future__ import annotations

import asyncio
import dataclasses
import marshal
import os
import signal
import time

import pytest

from sandbox.codecache import CodeCache, source_digest
from sandbox.compiler import compile_script
from sandbox.compiling import OFFERED_SOURCE_CHARS
from sandbox.pool import Limits, Pool

from tests.sandbox.poolkit import LIMITS, alive, event, ref, run_with_pool, wait_for

pytestmark = pytest.mark.timeout(90)

REPLY = "on endpoint(event):\n    event.reply({'v': %r})\n"
# Long enough that two requests started together hold two workers at once.
SLOW = ("on endpoint(event):\n    n = 0\n    for i in range(300000):\n        n += 1\n"
        "    event.reply({'v': %r})\n")


def _body(out: object) -> bytes:
    assert getattr(out, "status", None) == 200, out
    return out.body  # type: ignore[attr-defined, no-any-return]


def test_a_version_compiles_once_per_guild_and_every_worker_of_it_loads_it() -> None:
    src = SLOW % "one"

    async def scenario(pool: Pool) -> None:
        outs = await asyncio.gather(*(pool.run(ref(src, "logic_once"), event(), LIMITS, "g")
                                      for _ in range(2)))
        assert [_body(o) for o in outs] == [b'{"v":"one"}'] * 2
        assert len(pool._guild_idle["g"]) == 2   # two workers ran it ...
        assert pool.counters["compiles"] == 1    # ... from one compile
        # A version that does not compile is remembered too: its error, once.
        broken = "on endpoint(event):\n    event.reply(\n"
        outs = await asyncio.gather(*(pool.run(ref(broken, "logic_broken"), event(), LIMITS, "g")
                                      for _ in range(2)))
        for out in outs:
            assert out.error_kind == "script_error" and out.error_line == 2, out
        assert len(pool._guild_idle["g"]) == 2
        assert pool.counters["compiles"] == 2

    run_with_pool(scenario, size=2, max_workers=12)


def test_a_tampered_cached_code_object_is_never_run() -> None:
    src = REPLY % "genuine"
    evil = compile_script(REPLY % "tampered").script
    assert evil is not None

    async def scenario(pool: Pool) -> None:
        assert _body(await pool.run(ref(src, "logic_t"), event(), LIMITS, "a")) == \
            b'{"v":"genuine"}'
        codes = pool._codes
        assert codes is not None
        key = ("a", "logic_t", 1, source_digest("logic_t", 1, src))
        entry = codes.entries()[key]
        # Someone changes the cached bytes (the MAC stays the genuine one).
        codes.replace_entry(key, dataclasses.replace(entry, code=marshal.dumps(evil.code)))
        # The guild's worker goes; its next worker lacks the version: the entry must
        # not be shipped.
        (worker,) = pool._guild_idle["a"]
        os.kill(worker.pid, signal.SIGKILL)
        await wait_for(lambda: not worker.alive)
        assert _body(await pool.run(ref(src, "logic_t"), event(), LIMITS, "a")) == \
            b'{"v":"genuine"}'
        assert pool.counters["code_rejected"] == 1
        # The tampered entry was dropped; the worker that then compiled the source
        # offered its code, so the cache may hold the version again: genuine code.
        again = codes.entries().get(key)
        assert again is None or again.code != marshal.dumps(evil.code)

    run_with_pool(scenario, size=1, max_workers=6)


def test_code_compiled_for_one_guild_is_never_loaded_by_another() -> None:
    """Security review V1: a guild that took over the compile worker (a bug in
    CPython's parser or compiler) answers with crafted bytecode. Whatever the
    compile worker returned for guild A, with a valid MAC, must never run in
    guild B's workers, even for the same script key, version and source."""
    src = REPLY % "genuine"
    crafted = compile_script(REPLY % "crafted by guild a").script
    assert crafted is not None

    async def scenario(pool: Pool) -> None:
        assert _body(await pool.run(ref(src, "logic_x"), event(), LIMITS, "a")) == \
            b'{"v":"genuine"}'
        codes = pool._codes
        assert codes is not None and len(codes) == 1
        # Every entry now holds what the taken-over compile worker sent back.
        for key, entry in codes.entries().items():
            codes.put(key, marshal.dumps(crafted.code), entry.events, entry.has_endpoint,
                      entry.has_generators, entry.error)
        for guild in ("b", "c"):
            assert _body(await pool.run(ref(src, "logic_x"), event(), LIMITS, guild)) == \
                b'{"v":"genuine"}'
        assert pool.counters["code_rejected"] == 0   # not rejected: never looked up

    run_with_pool(scenario, size=1, max_workers=6)


def test_a_compile_worker_compiles_one_guilds_sources_then_is_replaced() -> None:
    """Security review V1: the compile worker that compiled guild A's source never
    compiles guild B's: B's request is compiled by B's own worker, and a compile
    for B's cache is done by another compile worker, A's being killed first."""
    async def scenario(pool: Pool) -> None:
        assert _body(await pool.run(ref(REPLY % 1, "logic_a1"), event(), LIMITS, "a")) == \
            b'{"v":1}'
        first = pool._compiler
        assert first is not None and first.alive and pool.counters["compiles"] == 1
        # Same guild: the same compile worker (no spare spent).
        assert _body(await pool.run(ref(REPLY % 2, "logic_a2"), event(), LIMITS, "a")) == \
            b'{"v":2}'
        assert pool._compiler is first and pool.counters["compiles"] == 2
        await wait_for(lambda: len(pool._idle) >= 2, timeout=30.0)
        # B's source never goes to A's compile worker: B's worker compiles it.
        assert _body(await pool.run(ref(REPLY % 3, "logic_b1"), event(), LIMITS, "b")) == \
            b'{"v":3}'
        assert pool._compiler is first and pool._compiler_guild == "a"
        assert pool.counters["worker_compiles"] == 1 and pool.counters["compiles"] == 2
        # A compile for B's cache (how a source too long to be offered gets there):
        # A's compile worker is killed and a fresh one compiles it.
        assert len(BIG) > OFFERED_SOURCE_CHARS
        key = ("b", "logic_b2", 1, source_digest("logic_b2", 1, BIG))
        pool._compile_later(key, BIG)
        codes = pool._codes
        assert codes is not None
        await wait_for(lambda: key in codes, timeout=30.0)
        second = pool._compiler
        assert second is not None and second is not first and second.pid != first.pid
        assert pool.counters["compiles"] == 3
        await wait_for(lambda: not alive(first.pid), timeout=30.0)
        assert sorted(k[0] for k in codes.entries()) == ["a", "a", "b", "b"]

    run_with_pool(scenario, size=2, max_workers=8)


def test_a_stale_entry_for_the_same_version_is_never_run() -> None:
    """Same key and version, another source (e.g. a restored database that reuses
    version numbers): the source digest is part of every cache key, the worker's too."""
    async def scenario(pool: Pool) -> None:
        assert _body(await pool.run(ref(REPLY % "old", "logic_s"), event(), LIMITS, "g")) == \
            b'{"v":"old"}'
        assert _body(await pool.run(ref(REPLY % "new", "logic_s"), event(), LIMITS, "g")) == \
            b'{"v":"new"}'
        assert pool.counters["workers"] <= 3   # the same guild worker served both
        assert pool.counters["compiles"] == 2

    run_with_pool(scenario, size=1, max_workers=3)


def test_a_script_update_runs_on_the_very_next_request_on_every_worker() -> None:
    async def scenario(pool: Pool) -> None:
        async def both(version: int, label: str) -> list[bytes]:
            r = ref(SLOW % label, "logic_u", version)
            outs = await asyncio.gather(pool.run(r, event(), LIMITS, "g"),
                                        pool.run(r, event(), LIMITS, "g"))
            return [_body(o) for o in outs]

        assert await both(1, "v1") == [b'{"v":"v1"}'] * 2
        workers = list(pool._guild_idle["g"])
        assert len(workers) == 2
        assert await both(2, "v2") == [b'{"v":"v2"}'] * 2
        # Both of the guild's workers ran version 2 (and no new worker did).
        assert sorted(pool._guild_idle["g"], key=id) == sorted(workers, key=id)
        for w in workers:
            assert any(k[:2] == ("logic_u", 2) for k in w.known)
            assert next(reversed(w.known))[:2] == ("logic_u", 2)

    run_with_pool(scenario, size=2, max_workers=6)


def test_without_the_code_cache_workers_compile_as_before() -> None:
    async def scenario(pool: Pool) -> None:
        outs = await asyncio.gather(*(pool.run(ref(REPLY % 1, "logic_p"), event(), LIMITS, f"g{i}")
                                      for i in range(3)))
        assert [_body(o) for o in outs] == [b'{"v":1}'] * 3
        assert pool.counters["compiles"] == 0

    run_with_pool(scenario, size=2, max_workers=8, code_cache_mb=0)


def test_code_cache_is_bounded_by_bytes_and_checks_its_mac() -> None:
    cache = CodeCache(max_bytes=4096)
    for i in range(20):
        cache.put(("g", "k", i, b"d" * 32), b"x" * 1000, ("endpoint",), True, False, None)
    assert cache.size_bytes <= 4096 and 0 < len(cache) < 20
    last = ("g", "k", 19, b"d" * 32)
    entry = cache.get(last)
    assert entry is not None and entry.code == b"x" * 1000
    # Bound to its key: the same bytes under another version do not verify ...
    cache.replace_entry(("g", "k", 99, b"d" * 32), entry)
    assert cache.get(("g", "k", 99, b"d" * 32)) is None and cache.rejected == 1
    # ... nor under another guild.
    cache.replace_entry(("h", "k", 19, b"d" * 32), entry)
    assert cache.get(("h", "k", 19, b"d" * 32)) is None and cache.rejected == 2


def test_a_dead_compile_worker_is_replaced_and_requests_still_answered() -> None:
    async def scenario(pool: Pool) -> None:
        assert _body(await pool.run(ref(REPLY % 1, "logic_d1"), event(), LIMITS, "g")) == \
            b'{"v":1}'
        compiler = pool._compiler
        assert compiler is not None and compiler.alive
        os.kill(compiler.pid, signal.SIGKILL)
        await wait_for(lambda: not alive(compiler.pid))
        # The next new version: a new compile worker (or, without a spare at that
        # moment, the guild's worker compiles it); either way it is answered.
        for version in range(2, 5):
            out = await pool.run(ref(REPLY % version, "logic_d1", version), event(), LIMITS, "g")
            assert _body(out) == b'{"v":%d}' % version
        # A compile worker again: later versions are compiled once, not by the worker.
        # (Bounded by time, not by a count of versions: on a loaded host the
        # spare that becomes the compile worker may take a while to start.)
        deadline = time.monotonic() + 30.0
        version = 5
        while True:
            replaced = pool._compiler
            if replaced is not None and replaced.alive and replaced.pid != compiler.pid:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"no new compile worker: {pool.counters}")
            out = await pool.run(ref(REPLY % version, "logic_d1", version), event(), LIMITS, "g")
            assert _body(out) == b'{"v":%d}' % version
            version += 1
            await asyncio.sleep(0.01)
        # Versions compiled by their workers meanwhile are compiled for the cache too.
        # Every compile done and counted (`_compiles` empty): an answer is counted
        # a loop turn after the compile worker is free again.
        await wait_for(lambda: not pool._compile_q and not pool._compiles
                       and pool._compiler is not None and pool._compiler.req is None,
                       timeout=30.0)
        before = pool.counters["compiles"]
        out = await pool.run(ref(REPLY % 99, "logic_d2"), event(), LIMITS, "g")
        assert _body(out) == b'{"v":99}'
        assert pool.counters["compiles"] == before + 1

    run_with_pool(scenario, size=1, max_workers=4)


# ~220 KB of straight-line code: a few hundred ms in the compiler.
BIG = "\n".join(["on endpoint(event):", "    t = 0"]
                + [f"    t = t + {i} * 2 - (t // 3)" for i in range(7000)]
                + ["    event.reply(t)"]) + "\n"


def test_a_guilds_long_compile_does_not_hold_another_guilds_new_version() -> None:
    async def scenario(pool: Pool) -> None:
        order: list[str] = []

        async def run(name: str, source: str, guild: str) -> None:
            out = await pool.run(ref(source, f"logic_{name}"), event(), LIMITS, guild)
            assert out.status == 200, out
            order.append(name)

        big = asyncio.ensure_future(run("big", BIG, "a"))
        compiler = pool._compiler
        assert compiler is not None
        while compiler.req is None:
            await asyncio.sleep(0.001)   # A's source is in the compile worker now
        busy_with = compiler.req
        await run("small", REPLY % "b", "b")
        # B was answered while the compile worker was still on A's source: B did not
        # queue behind it (its own worker compiled it).
        assert compiler.req is busy_with and not big.done()
        await big
        assert order == ["small", "big"]
        # B's version reached the cache from B's own worker, which compiled it for
        # the request and offered the code (it is bound to B, as a compile worker
        # would be): no compile worker was spent on B, A's never saw B's source.
        small = REPLY % "b"
        key = ("b", "logic_small", 1, source_digest("logic_small", 1, small))
        codes = pool._codes
        assert codes is not None
        await wait_for(lambda: key in codes, timeout=30.0)
        assert pool.counters["worker_compiles"] == 1 and pool.counters["compiles"] == 1
        assert pool._compiler is compiler and pool._compiler_guild == "a"
        assert not pool._compile_q   # B's queued background compile was dropped

    run_with_pool(scenario, size=2, max_workers=6)


def test_the_digest_memo_is_exact_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    from sandbox import codecache
    monkeypatch.setattr(codecache, "_DIGEST_CHARS", 1000)
    for i in range(50):
        src = f"# {i}\n" + "x" * 97
        assert source_digest("logic_m", i, src) == hashlib.sha256(src.encode()).digest()
    held = sum(len(s) for s, _ in codecache._known_digests.values())
    assert held <= 1000 and held == codecache._memo_chars[0]
    # Same key and version, another source: never the remembered digest.
    other = "# other\n"
    assert source_digest("logic_m", 49, other) == hashlib.sha256(other.encode()).digest()


def test_the_compile_worker_never_runs_a_script() -> None:
    """Code is produced only by a process that never ran any script: no job is ever
    dispatched to the compile worker, and it is no guild's worker."""
    from typing import Any
    dispatched: list[Any] = []

    async def scenario(pool: Pool) -> None:
        dispatch = pool._dispatch

        def recording(w: Any, req: Any) -> None:
            dispatched.append((w, req.kind))
            dispatch(w, req)

        pool._dispatch = recording  # type: ignore[method-assign]
        compiler = pool._compiler
        assert compiler is not None
        outs = await asyncio.gather(*(pool.run(ref(REPLY % i, f"logic_c{i}"), event(), LIMITS,
                                               f"g{i % 3}") for i in range(9)))
        assert all(o.status == 200 for o in outs)
        assert pool.counters["compiles"] >= 1
        assert dispatched and all(w is not compiler for w, _ in dispatched)
        assert compiler.guild not in {f"g{i}" for i in range(3)}
        assert compiler.pid not in pool.worker_pids[:-1]   # listed last, as no guild's

    run_with_pool(scenario, size=2, max_workers=8)


#: Compiles in ~0.5 s of CPU on a 2-vCPU host, within every static bound.
SLOW_TO_COMPILE = "".join(
    f"def f{i}(x):\n    y = [x, {i}, x * {i}, (x, {i}), {{'a': x, 'b': {i}}}]\n"
    f"    return y[0] + y[1] - len(y)\n" for i in range(1800)) + \
    "on endpoint(event):\n    event.reply(1)\n"


@pytest.mark.parametrize(("code_cache_mb", "cpu_spent"), [(0, True), (64, True), (0, False)])
def test_a_compile_past_the_budget_is_killed_and_counted_only_when_it_spent_the_cpu_budget(
        monkeypatch: pytest.MonkeyPatch, code_cache_mb: int, cpu_spent: bool) -> None:
    # Outside review, session 17: no test killed a worker, or the compile
    # worker, past the compile budget; and a worker past it answered "script
    # ran longer than 1000 ms" and was tried again at every request, each
    # holding a worker for the whole budget. Now the overrun is a script error;
    # it counts like a crash (the third within the window quarantines the
    # version) only when the worker used the save-time CPU budget: an overrun
    # of wall time alone may be load, which many first requests at once can
    # make (a second review quarantined a healthy version that way).
    # (Budget 200 ms of wall time here; the source takes ~0.5 s of CPU. At
    # 50 ms a loaded host gave the worker under 10 ms of CPU in its budget:
    # the [0-True] case then saw no CPU overrun, once in a full parallel run.)
    import sandbox.compiling
    import sandbox.pool
    from sandbox import limits
    monkeypatch.setattr(sandbox.pool, "COMPILE_BUDGET_MS", 200)
    monkeypatch.setattr(sandbox.compiling, "COMPILE_BUDGET_MS", 200)
    if cpu_spent:   # as if 10 ms of CPU compiling were the save-time CPU budget
        monkeypatch.setattr(limits, "COMPILE_CPU_BUDGET_S", 0.01)

    async def scenario(pool: Pool) -> list[tuple[str | None, str | None, int]]:
        seen = []
        for _ in range(4):
            out = await pool.run(ref(SLOW_TO_COMPILE), event(), Limits(1000, 4096))
            seen.append((out.error_kind, out.error_message, pool.counters["compile_failures"]))
        return seen

    seen = run_with_pool(scenario, size=2, code_cache_mb=code_cache_mb)
    overruns = seen[:3] if cpu_spent else seen
    for kind, message, _ in overruns:
        assert kind == "script_error" and message is not None
        assert message.startswith("script took too long to compile in its worker"), message
    if cpu_spent:
        kind, message, _ = seen[3]
        assert kind == "crash" and message is not None and "quarantined" in message \
            and "its compile passed the compile budget" in message, message
    # With the code cache the compile worker went first, and was killed too.
    assert [n for _, _, n in seen[:3]] == ([1, 2, 3] if code_cache_mb else [0, 0, 0])


def test_the_queue_of_compiles_for_the_cache_is_bounded() -> None:
    # What guilds' long sources queue for the compile worker (nobody waits
    # for them) stays within BACKGROUND_COMPILES sources and BACKGROUND_CHARS
    # characters, however many are sent (outside review, session 17: no test),
    # one guild's within its share of both, so that its flood leaves room for
    # the other guilds' versions (red-team pass, session 34).
    from sandbox.compile_queue import BACKGROUND_CHARS, BACKGROUND_COMPILES, BACKGROUND_SHARE

    def emptied(pool: Pool) -> None:
        for item in list(pool._compile_q):        # as if compiled
            pool._compiles.pop(item[0], None)
        pool._compile_q.clear()

    def queued(pool: Pool, guild: str | None = None) -> tuple[int, int]:
        mine = [s for key, s, _ in pool._compile_q if guild in (None, key[0])]
        return len(mine), sum(map(len, mine))

    async def scenario(pool: Pool) -> dict[str, tuple[int, int]]:
        await pool.run(ref(REPLY % 0, "logic_warm"), event(), LIMITS, "a")   # binds the loop
        seen = {}
        for i in range(BACKGROUND_COMPILES + 50):     # one guild, many small sources
            pool._compile_later(("a", f"logic_s{i}", 1, f"{i:064x}"), "# small\n")
        seen["one guild, by count"] = queued(pool, "a")
        for g in range(BACKGROUND_SHARE + 4):         # many guilds, many small sources
            for i in range(BACKGROUND_COMPILES):
                pool._compile_later((f"g{g}", f"logic_s{i}", 1, f"{i:064x}"), "# small\n")
        seen["all guilds, by count"] = queued(pool)
        emptied(pool)
        big = "#" + "x" * (1 << 20) + "\n"            # 1 MiB of characters each
        for i in range(40):
            pool._compile_later(("a", f"logic_b{i}", 1, f"{i:064x}"), big)
        seen["one guild, by size"] = queued(pool, "a")
        pool._compile_later(("b", "logic_b", 1, f"{0:064x}"), big)
        seen["another guild after it"] = queued(pool, "b")
        for g in range(BACKGROUND_SHARE + 4):
            for i in range(40):
                pool._compile_later((f"g{g}", f"logic_b{i}", 1, f"{i:064x}"), big)
        seen["all guilds, by size"] = queued(pool)
        return seen

    seen = run_with_pool(scenario, size=2)
    share = BACKGROUND_COMPILES // BACKGROUND_SHARE
    # (one source may already be with the compile worker, off the queue)
    assert share - 1 <= seen["one guild, by count"][0] <= share
    assert BACKGROUND_COMPILES - 1 <= seen["all guilds, by count"][0] <= BACKGROUND_COMPILES
    mib = (1 << 20) + 2
    count, chars = seen["one guild, by size"]
    assert chars <= BACKGROUND_CHARS // BACKGROUND_SHARE
    assert count >= BACKGROUND_CHARS // BACKGROUND_SHARE // mib - 1
    assert seen["another guild after it"][0] == 1
    count, chars = seen["all guilds, by size"]
    assert chars <= BACKGROUND_CHARS and count >= BACKGROUND_CHARS // mib - 1


def test_one_guild_compiling_many_versions_keeps_the_other_guilds_code() -> None:
    # A guild that compiled 70 large versions emptied the shared cache: another
    # guild's next new worker compiled its script again (0.8 s of its own time)
    # and a guild could tell that others had compiled (review, session 29).
    cache = CodeCache()
    theirs = ("B", "logic_b", 1, b"b" * 32)
    cache.put(theirs, b"y" * 200_000, ("endpoint",), True, False, None)
    for version in range(200):
        cache.put(("A", "logic_a", version, b"a" * 32), b"x" * 1_000_000, ("endpoint",), True,
                  False, None)
    entry = cache.get(theirs)
    assert entry is not None and entry.code == b"y" * 200_000
    assert cache.held("A") <= cache.max_bytes // 16
    assert cache.get(("A", "logic_a", 199, b"a" * 32)) is not None   # its newest stay
    assert cache.get(("A", "logic_a", 0, b"a" * 32)) is None


def test_a_compile_in_flight_when_the_loop_closed_does_not_hold_the_next_loop() -> None:
    # The pool is rebound when its event loop closes (`Pool.attach`): a compile
    # the compile worker was on then is forgotten with the loop, so the same
    # version asked for on the next loop is compiled again, not waited for.
    pool = Pool(size=1, max_workers=4)
    pool.start()
    try:
        async def first() -> None:
            asyncio.ensure_future(pool.run(ref(BIG, "logic_big"), event(), LIMITS, "a"))
            compiler = pool._compiler
            assert compiler is not None
            while compiler.req is None:
                await asyncio.sleep(0.001)   # left compiling: its loop closes under it

        asyncio.run(first())

        async def second() -> None:
            out = await asyncio.wait_for(
                pool.run(ref(BIG, "logic_big"), event(), LIMITS, "a"), 20.0)
            assert out.status == 200, out
            await pool.stop()

        asyncio.run(second())
    finally:
        if pool._state != "stopped":
            asyncio.run(pool.stop())


def test_a_version_too_big_to_ship_is_a_compile_error_remembered_not_a_crash() -> None:
    # A version saved before the bytecode limit (or by a store this service did
    # not check) made 7 MiB of code: the compile worker died writing its answer
    # and the request's worker compiled it again, every request (red-team pass,
    # session 34). Now it does not compile, once, and nothing dies.
    from tests.service.core.test_script_compile import finally_in_finally
    bomb = finally_in_finally(11)

    async def scenario(pool: Pool) -> tuple[list[object], dict[str, int]]:
        outs = []
        for _ in range(3):
            out = await pool.run(ref(bomb, "logic_bomb"), event({"a0": 1}), LIMITS, "g")
            outs.append((out.status, out.error_kind, out.error_message))
        return outs, pool.counters

    from sandbox import compiler, protocol
    assert protocol.MAX_SHIPPED_CODE == compiler.MAX_CODE_BYTES   # every version can be sent
    outs, counters = run_with_pool(scenario, size=1, max_workers=4)
    for status, kind, message in outs:
        assert (status, kind) == (500, "script_error"), outs
        assert "MiB of bytecode, over the 2 MiB limit" in (message or ""), outs
    assert counters["crashes"] == 0 and counters["restarts"] == 0, counters
