"""The worker process: harden itself, then serve jobs from its channel.

A worker is forked by the fork server (``sandbox.zygote``), hardens itself
(``sandbox.hardening``), reports which layers took effect, then loops:
receive a job, load the script version if it is not in the LRU cache (from
the marshalled code the service ships, ``sandbox.codecache``; compiling the
source only when none came), run ``run_endpoint`` with the memory accountant armed, reply.  It never
decides about time: the supervisor SIGKILLs it past the deadline.  The
pool's compile worker gets ``compile`` messages instead and never runs a script
(the pool sends it the sources of one guild only, ``sandbox.compiling``).

A worker exits (and the pool replaces it) after any job that broke the memory
cap or failed inside the runtime itself, and after any job that left its
resident size more than ``max_rss_growth`` above its size at start-up, so
nothing a misbehaving script did can accumulate. Compiles run under the
guard (``limits.COMPILE_MEMORY_BYTES``) and every job under a per-job
address-space bound (``limits.AddressSpaceLimit``).
"""
from __future__ import annotations

import marshal
import os
import select
import signal
import socket
import time
import types
from collections import OrderedDict
from dataclasses import dataclass
from collections.abc import Callable
from types import FrameType
from typing import Any, NoReturn

from sandbox import hardening, limits, protocol
from sandbox.errors import ProtocolError

OUTPUT_CAP = 16384
EXIT_EOF = 0
EXIT_PROTOCOL = 65
EXIT_HOOK_REFUSED = 66


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs, fixed when the pool is built."""

    hardening: hardening.HardeningConfig
    compile_cache: int = 64
    prefer_memguard: bool = True
    test_hooks: bool = False
    spin_us: int = 0
    #: Resident bytes a worker may keep beyond its start-up size; it retires past
    #: them (0: ``limits.MAX_RSS_GROWTH_BYTES``).
    max_rss_growth: int = 0


def _error_result(kind: str, message: str, line: int | None = None,
                  status: int = 500) -> dict[str, Any]:
    if len(message) > protocol.MAX_ERROR_MESSAGE_CHARS:  # e.g. a compile error naming a long name
        message = message[:protocol.MAX_ERROR_MESSAGE_CHARS - 3] + "..."
    return {"replied": False, "status": status, "headers": [], "body": b"",
            "contentType": "", "output": "",
            "error": {"kind": kind, "message": message, "line": line, "traceback": None}}


class _Runner:
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
        #: Whether a script ever ran here: code this worker compiles is offered to the
        #: service's code cache only before, when the process has seen nothing but
        #: compiler input (as a compile worker), never after a script could have
        #: taken it over.
        self._ran = False

    def release_limits(self) -> None:
        """Back to the worker's own address-space limit (before a test hook)."""
        self._as.release()

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
            meta = {"events": list(script.events), "endpoint": script.has_endpoint,
                    "gen": script.has_generators, "err": None}
        else:
            first = compiled.errors[0] if compiled.errors else None
            message = first.message if first else "script does not compile"
            if len(message) > protocol.MAX_ERROR_MESSAGE_CHARS:
                message = message[:protocol.MAX_ERROR_MESSAGE_CHARS - 3] + "..."
            err = [first.line if first else None, message]
            meta = {"events": [], "endpoint": False, "gen": False, "err": err}
        self._mem.refresh()
        exit_after = (self._mem.resident - self._rss_at_start > self._max_rss_growth
                      or self._compile_over)
        return {"t": "code", "id": msg["id"], "code": code, "meta": meta, "exit": exit_after}

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Run one job message; returns the reply message."""
        # Bound to the source's digest too: a version whose source changed
        # (a restored database reusing version numbers) is never served from
        # the old entry.
        key = (msg["key"], msg["ver"], msg["dig"])
        compiled = self._cache.get(key)
        # The supervisor's kill comes ``ms`` (plus a grace) after it sent the job,
        # or after it heard "compiled" when this worker compiles the source.
        left = msg["until"] - time.monotonic()
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
                left = msg["ms"] / 1000.0
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
            result = _error_result("script_error",
                                   first.message if first else "script does not compile",
                                   first.line if first else None)
            return self._reply(msg["id"], result, 0, False, 0.0, exit_after)

        cap = msg["mem"]
        self._ran = True
        t0 = time.perf_counter()
        report = self._report_type()
        self._as.bound(self._mem.mapped, cap)
        self._acct.arm(cap)
        # At the time limit the script is not stopped here (the supervisor
        # kills the worker, as before): the timer only reports where it was.
        self._running = (msg["id"], compiled.script)
        # A job that reached the worker late on a busy host still reports where
        # the script was before the supervisor's kill (never later than ``ms``).
        signal.setitimer(signal.ITIMER_REAL, min(max(left, 0.0002), msg["ms"] / 1000.0))
        try:
            result = self._run(compiled.script, msg["event"], output_cap=OUTPUT_CAP,
                               report=report)
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
            result = _error_result("script_memory_exceeded",
                                   f"script memory exceeded the {cap // 1024} KB cap", line)
            result["output"] = output
            result["error"]["traceback"] = tb
            exit_after = True
        elif failure is not None:
            kind = "script_memory_exceeded" if isinstance(failure, MemoryError) else "crash"
            result = _error_result(kind, f"sandbox runtime failed: {type(failure).__name__}")
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
        # What the worker keeps after the job: past the bound it retires, so
        # memory left in library caches or fragments never accumulates.
        self._ran = True   # offers end with the first job, as the service counts them
        self._mem.refresh()
        rss = self._mem.resident
        if rss - self._rss_at_start > self._max_rss_growth or self._compile_over:
            exit_after = True
        return {"t": "res", "id": job_id, "r": result, "peak": peak, "over": over,
                "dur": dur, "exit": exit_after, "rss": rss}


def _shippable(script: Any) -> tuple[bytes, dict[str, Any]] | None:
    """A compiled script as the reply carries it (None past ``MAX_SHIPPED_CODE``)."""
    code = marshal.dumps(script.code)
    if len(code) > protocol.MAX_SHIPPED_CODE:
        return None
    return code, {"events": list(script.events), "endpoint": script.has_endpoint,
                  "gen": script.has_generators, "err": None}


def _test_exec(code: str) -> tuple[bool, Any]:
    """TEST HOOK: unrestricted exec inside a hardened worker (pool must enable it)."""
    ns: dict[str, Any] = {}
    try:
        exec(compile(code, "<test-hook>", "exec"), ns)  # noqa: S102 - test-only, see docstring
    except BaseException as exc:
        return False, f"{type(exc).__name__}: {exc}"
    value = ns.get("result")
    try:
        protocol.encode({"v": value}, protocol.MAX_REPLY_BYTES)
    except ProtocolError:
        value = repr(value)
    return True, value


def _send(sock: socket.socket, message: dict[str, Any]) -> dict[str, Any]:
    """Send one message; returns what was actually sent."""
    try:
        frame = protocol.encode(message, protocol.MAX_REPLY_BYTES)
    except ProtocolError:
        if "code" in message and message.get("t") == "compiled":
            # The offered code is too large to send: "compiled" without it.
            return _send(sock, {"t": "compiled", "id": message["id"]})
        if message.get("t") != "res":
            raise
        # Too large or not encodable: the script's reply was invalid.
        message = {**message, "exit": True,
                   "r": _error_result("invalid_reply", "script reply is too large to return")}
        frame = protocol.encode(message, protocol.MAX_REPLY_BYTES)
    sock.sendall(frame)
    return message


def _spin_until_readable(sock: socket.socket, spin_s: float) -> None:
    """Poll briefly (yielding the CPU) before blocking in recv.

    A sleeping worker on another core can take ~100 us to wake on some
    virtual machines; when the next job comes within the spin it is picked up
    at once.  Off by default: it costs up to ``spin_s`` of CPU per job.
    """
    end = time.perf_counter() + spin_s
    peek = socket.MSG_PEEK | socket.MSG_DONTWAIT
    while time.perf_counter() < end:
        try:
            sock.recv(1, peek)
            return
        except BlockingIOError:
            os.sched_yield()


def serve(channel_fd: int, cfg: WorkerConfig, seccomp_filter: Any,
          shared_netns: tuple[bool, str] | None = None, forked_at: float = 0.0,
          root_fd: int = -1) -> NoReturn:
    """Worker entry point after fork; never returns.

    ``shared_netns``: the fork server's network namespace result (see
    ``hardening.share_network_namespace``); ``forked_at``: its
    ``perf_counter()`` just before the fork, so the ready message can say
    what each start-up step cost (``ms``: fork, harden, init); ``root_fd``:
    the empty directory to ``chroot`` into (``hardening.make_empty_root``).
    """
    try:
        t_child = time.perf_counter()
        fd, report = hardening.harden(channel_fd, cfg.hardening, seccomp_filter, shared_netns,
                                      root_fd)
        t_hard = time.perf_counter()
        sock = socket.socket(fileno=fd)
        sock.setblocking(True)
        accountant = limits.make_accountant(cfg.prefer_memguard)
        report.set("memguard", accountant.enforcing,
                   "tracemalloc in use (extension not built or disabled): memory is "
                   "judged after the run; RLIMIT_AS alone stops a growing loop")
        runner = _Runner(cfg, accountant)
        runner.on_compiled = lambda job_id, offer: _send(
            sock, {"t": "compiled", "id": job_id} if offer is None
            else {"t": "compiled", "id": job_id, "code": offer[0], "meta": offer[1]})
        runner.send_where = lambda message: _send(sock, message)
        signal.signal(signal.SIGALRM, runner.on_time_limit)
        t_init = time.perf_counter()
        steps = {"fork": max(t_child - forked_at, 0.0) * 1000.0 if forked_at else 0.0,
                 "harden": (t_hard - t_child) * 1000.0, "init": (t_init - t_hard) * 1000.0}
        _send(sock, {"t": "ready", "pid": os.getpid(), "hard": report.layers,
                     "notes": report.notes, "ms": steps})
        waiting = select.poll()
        waiting.register(fd, select.POLLIN)
        while True:
            if cfg.spin_us:
                _spin_until_readable(sock, cfg.spin_us / 1e6)
            # Wait in poll(), not in a blocking recv(): the service reading our
            # reply frees our socket's send space, and that wakes a task
            # blocked in recv() (for nothing) but not one in poll(POLLIN).
            waiting.poll()
            try:
                msg = protocol.check_job(protocol.recv_message(sock, protocol.MAX_JOB_BYTES))
            except EOFError:
                os._exit(EXIT_EOF)
            if msg["t"] == "exec":
                if not cfg.test_hooks:
                    os._exit(EXIT_HOOK_REFUSED)
                runner.release_limits()
                ok, value = _test_exec(msg["code"])
                _send(sock, {"t": "xres", "id": msg["id"], "ok": ok, "value": value})
                continue
            if msg["t"] == "compile":
                sent = _send(sock, runner.compile_only(msg))
            else:
                sent = _send(sock, runner.handle(msg))
            if sent.get("exit"):
                os._exit(EXIT_EOF)
    except ProtocolError:
        os._exit(EXIT_PROTOCOL)
    except BaseException:
        os._exit(70)
