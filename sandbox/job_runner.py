"""One worker's jobs: the script versions it keeps, and one job run.

`JobRunner` is what a worker (``sandbox.worker``) does with each message:
load the script version if it is not in its LRU cache (from the marshalled
code the service ships, ``sandbox.codecache``; compiling the source only when
none came), run ``run_endpoint`` with the memory accountant armed and the
address-space bound set, and build the reply. Kept apart from the process's
loop so tests and benches can drive it in-process.

A job that broke the memory cap or failed inside the runtime itself, or that
left the worker's resident size more than ``max_rss_growth`` above its size
at start-up, asks the worker to exit (and the pool replaces it), so nothing a
misbehaving script did can accumulate. Compiles run under the guard
(``limits.COMPILE_MEMORY_BYTES``).
"""
from __future__ import annotations

import marshal
import signal
import time
import types
from collections import OrderedDict
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from sandbox import limits, protocol
from sandbox.errors import ProtocolError

if TYPE_CHECKING:
    from sandbox.worker import WorkerConfig

OUTPUT_CAP = 16384
#: Room a frame of N bytes needs to be read and decoded: N times this, plus the next.
DECODE_ROOM_FACTOR = 112
DECODE_ROOM_BYTES = 8 << 20


def error_result(kind: str, message: str, line: int | None = None,
                  status: int = 500) -> dict[str, Any]:
    return {"replied": False, "status": status, "headers": [], "body": b"",
            "contentType": "", "output": "",
            "error": {"kind": kind, "message": _capped(message), "line": line,
                      "traceback": None}}


def _capped(message: str) -> str:
    """An error message within the protocol's cap (e.g. a compile error naming a long name)."""
    cap = protocol.MAX_ERROR_MESSAGE_CHARS
    return message if len(message) <= cap else message[:cap - 3] + "..."


class JobRunner:
    """Compile cache plus one job; kept apart from the loop so tests can drive it."""

    #: Tells the supervisor a compile finished, so the script's clock starts now.
    #: ``(job id, offered code or None)``: the offer is the marshalled code and its
    #: meta, made only while this worker has never run a script (see ``handle``).
    on_compiled: Callable[[int, tuple[bytes, dict[str, Any]] | None], object] | None = None
    #: Tells the supervisor where a script was when its time ran out (SIGALRM).
    send_where: Callable[[dict[str, Any]], object] | None = None
    #: (job id, compiled script) while a script runs; the timer's handler reads it.
    _running: tuple[int, Any] | None = None

    def __init__(self, cfg: WorkerConfig, accountant: limits.MemoryAccountant) -> None:
        from sandbox.compiler import compile_script
        from sandbox.runtime import RunReport, prepare_worker_process, run_endpoint
        prepare_worker_process()  # warnings off, integer digit limit pinned
        self._compile = compile_script
        self._run = run_endpoint
        self._report_type = RunReport
        self._cfg = cfg
        self._acct = accountant
        self._cpu = limits.CpuBackstop(cfg.hardening.cpu_lifetime_s)
        # Same size and same move/evict order as the parent's mirror of it, so
        # the parent knows which versions it need not send again.
        self._cache: OrderedDict[tuple[str, int, bytes], Any] = OrderedDict()
        self._mem = limits.ProcessMemory()
        self._as = limits.AddressSpaceLimit()
        self._rss_at_start = self._mem.resident
        self._max_rss_growth = cfg.max_rss_growth or limits.MAX_RSS_GROWTH_BYTES
        self._compile_over = False
        #: Whether a script ever ran here: only before (nothing but compiler input
        #: seen, as a compile worker) is code this worker compiles offered to the
        #: service's code cache, never after a script could have taken it over.
        self._ran = False

    def release_limits(self) -> None:
        """Back to the worker's own address-space limit (before a test hook)."""
        self._as.release()

    def before_frame(self, size: int) -> None:
        """The next message's frame holds ``size`` bytes: make sure the last
        job's address-space bound leaves room to read and decode it.

        Decoding can take ~100 times the frame (a body of many small
        containers: an empty map is one byte of msgpack and ~100 bytes of
        Python objects), and the last job's event is still held meanwhile.
        The event is the caller's data, never charged to a script: where the
        bound leaves too little room, the worker's own limit applies until the
        job sets its own (a 1 MiB body of small records under the pro plan's
        bound killed every second worker before its script ran). A frame of a
        few KB after a job that kept little needs no system call."""
        self._as.make_room(self._mem.mapped, DECODE_ROOM_FACTOR * size + DECODE_ROOM_BYTES)

    def _compile_guarded(self, src: str) -> Any:
        """Compile under the guard's compile cap and the address-space bound."""
        from sandbox.compiler import CompileError, CompileResult
        self._as.bound(self._mem.mapped, limits.COMPILE_MEMORY_BYTES)
        # tracemalloc (no _memguard) would slow the compile 8-24x: then only
        # the address-space bound holds it.
        guarded = self._acct.enforcing
        if guarded:
            self._acct.arm(limits.COMPILE_MEMORY_BYTES)
        try:
            compiled = self._compile(src)
        finally:
            over = self._acct.disarm()[1] if guarded else False
        if over:
            self._compile_over = True
            compiled = CompileResult(None, (CompileError(
                1, 1, f"script needs more than {limits.COMPILE_MEMORY_BYTES >> 20} MB of "
                      "memory to compile"),))
        return compiled

    def _load(self, src: str, code: bytes | None, meta: dict[str, Any]) -> Any:
        """A script version from the marshalled code the service sent (no compile)."""
        from sandbox.compiler import CompiledScript, CompileError, CompileResult
        err = meta["err"]
        if err is not None or code is None:
            line, message = err if err is not None else (1, "script does not compile")
            return CompileResult(None, (CompileError(line or 1, 1, message),))
        loaded = marshal.loads(code)
        if type(loaded) is not types.CodeType:
            raise ProtocolError("shipped code is not a code object")
        return CompileResult(CompiledScript(loaded, tuple(meta["events"]), meta["endpoint"],
                                            tuple(src.split("\n")), meta["gen"]), ())

    def compile_only(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A ``compile`` message (this worker is the pool's compile worker: it never
        runs a script, and the pool sends it one guild's sources only, killing it
        before another guild's): the marshalled code, or the first compile error."""
        self._cpu.before_job(limits.COMPILE_BUDGET_MS)
        compiled = self._compile_guarded(msg["src"])
        script = compiled.script
        code: bytes | None = None
        err: list[Any] | None = None
        if compiled.ok and script is not None:
            code = marshal.dumps(script.code)
            meta = _meta(script)
        else:
            first = compiled.errors[0] if compiled.errors else None
            err = [first.line if first else None,
                   _capped(first.message if first else "script does not compile")]
            meta = {"events": [], "endpoint": False, "gen": False, "err": err}
        return {"t": "code", "id": msg["id"], "code": code, "meta": meta, "exit": self._spent()}

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Run one job message; returns the reply message."""
        # Bound to the source's digest too: a version whose source changed
        # (a restored database reusing version numbers) is never served from
        # the old entry.
        key = (msg["key"], msg["ver"], msg["dig"])
        compiled = self._cache.get(key)
        until = msg["until"]   # the service's clock: when it counts ``ms`` from the send
        if compiled is None:
            src = msg["src"]
            if src is None:
                return {"t": "need", "id": msg["id"]}
            if msg.get("meta") is not None:
                # Compiled once by the pool's compile worker: loaded, not compiled.
                compiled = self._load(src, msg.get("code"), msg["meta"])
            else:
                # The compile has its own budget: the supervisor allows COMPILE_BUDGET_MS
                # until it hears "compiled", then the script's own time limit.
                self._cpu.before_job(msg["ms"] + limits.COMPILE_BUDGET_MS)
                compiled = self._compile_guarded(src)
                until = time.monotonic() + msg["ms"] / 1000.0   # from "compiled" on
                if self.on_compiled is not None:
                    offer = None
                    if not self._ran and compiled.ok and compiled.script is not None:
                        offer = _shippable(compiled.script)
                    self.on_compiled(msg["id"], offer)
            self._cache[key] = compiled
            if len(self._cache) > self._cfg.compile_cache:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)

        exit_after = not self._cpu.before_job(msg["ms"])
        result: dict[str, Any] | None
        if not compiled.ok or compiled.script is None:
            first = compiled.errors[0] if compiled.errors else None
            result = error_result("script_error",
                                   first.message if first else "script does not compile",
                                   first.line if first else None)
            return self._reply(msg["id"], result, 0, False, 0.0, exit_after)

        cap = msg["mem"]
        self._ran = True
        t0 = time.perf_counter()
        report = self._report_type()
        self._as.bound(self._mem.mapped, cap)
        self._acct.arm(cap)
        # At the time limit the script is not stopped here (the supervisor kills the
        # worker): the timer only reports where it was, before the kill even when
        # the job reached this worker late on a busy host (never later than ``ms``).
        self._running = (msg["id"], compiled.script)
        left = min(until - time.monotonic(), msg["ms"] / 1000.0)
        signal.setitimer(signal.ITIMER_REAL, max(left, 0.0002))
        try:
            # The event as decoded: allocated before the guard was armed, and
            # the script's alone (never copied, never charged to its cap).
            result = self._run(compiled.script, msg["event"], output_cap=OUTPUT_CAP,
                               report=report, decoded=True)
            failure: BaseException | None = None
        except BaseException as exc:  # the runtime promises plain data; anything else is a fault
            result = None
            failure = exc
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            self._running = None
            peak, over = self._acct.disarm()
            # The bound stays until the next job sets its own (no system call
            # while it does not change): the reply is encoded within it, from
            # memory the script's objects just freed.
        dur = (time.perf_counter() - t0) * 1000.0
        if report.leaked:
            # Script code outlived the invocation inside a library cache; it
            # could run during the next guild's invocation: retire the worker.
            exit_after = True
        if over:
            line, tb, output = None, None, ""
            if result is not None:
                output = result["output"]  # what it printed still helps its author
                if result.get("error"):   # where the failing allocation was
                    line, tb = result["error"].get("line"), result["error"].get("traceback")
            result = error_result("script_memory_exceeded",
                                   f"script memory exceeded the {cap // 1024} KB cap", line)
            result["output"] = output
            result["error"]["traceback"] = tb
            exit_after = True
        elif failure is not None:
            kind = "script_memory_exceeded" if isinstance(failure, MemoryError) else "crash"
            result = error_result(kind, f"sandbox runtime failed: {type(failure).__name__}")
            exit_after = True
        return self._reply(msg["id"], result, peak, over, dur, exit_after)

    def on_time_limit(self, signum: int, frame: FrameType | None) -> None:
        """SIGALRM at the script's time limit: send the script line it is
        executing and its script frames, once; the script runs on until the
        supervisor's kill (a handler that stopped it could be caught by it)."""
        running, self._running = self._running, None
        if running is None or self.send_where is None:
            return
        job_id, script = running
        try:
            from sandbox.runtime import script_frames, script_traceback
            frames = script_frames(frame, script)
            self.send_where({"t": "where", "id": job_id,
                             "line": frames[-1][0] if frames else None,
                             "tb": script_traceback(frames, script, "stopped by the time limit")})
        except BaseException:  # noqa: BLE001 - a report must never change what the script does
            pass

    def _reply(self, job_id: int, result: Any, peak: int, over: bool, dur: float,
               exit_after: bool) -> dict[str, Any]:
        self._ran = True   # offers end with the first job, as the service counts them
        exit_after = self._spent() or exit_after
        return {"t": "res", "id": job_id, "r": result, "peak": peak, "over": over,
                "dur": dur, "exit": exit_after, "rss": self._mem.resident}

    def _spent(self) -> bool:
        """Whether this worker must retire: what it keeps after a job or compile is
        past the bound (memory left in library caches or fragments never
        accumulates), or a compile broke the compile cap."""
        self._mem.refresh()
        return (self._mem.resident - self._rss_at_start > self._max_rss_growth
                or self._compile_over)


def _shippable(script: Any) -> tuple[bytes, dict[str, Any]] | None:
    """A compiled script as the reply carries it (None past ``MAX_SHIPPED_CODE``)."""
    code = marshal.dumps(script.code)
    return None if len(code) > protocol.MAX_SHIPPED_CODE else (code, _meta(script))


def _meta(script: Any) -> dict[str, Any]:
    """What a compiled script's marshalled code travels with."""
    return {"events": list(script.events), "endpoint": script.has_endpoint,
            "gen": script.has_generators, "err": None}
