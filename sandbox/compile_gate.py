"""The save-time compile: a source is compiled once, in a sandboxed process,
within a CPU and a memory budget, before any worker ever sees it.

``check_source(text)`` returns a :class:`Verdict`: ``ok``, or the compile errors.
Every front saves scripts through ``service.core.scripts``, which calls it, so a
source a worker receives is known to compile within budget (redteam finding 5:
a 256 KB source that took 16-20 s to compile held a worker per request).

Each save's compile process is forked for it by the compile server
(``sandbox.compile_server``: a fresh interpreter, empty environment, only the
sandbox imported, which never sees a source). The process reads the source
from its socket, then hardens itself as a worker does (rlimits, no network,
the sandbox user when started as root, no new privileges, Landlock,
seccomp), arms a CPU timer (``ITIMER_PROF``: SIGPROF ends it when the budget
is spent, even inside CPython's C compiler) and the memory guard, compiles,
and writes the verdict as JSON. The verdict is remembered per guild and
source (an LRU keyed by both, the source by its SHA-256, in which a guild's
saves push out only its own verdicts): saving the same text again costs nothing and a source over budget is never compiled twice
for a guild by this process.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pwd
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from sandbox import compile_server, landlock, limits
from sandbox.compiler import MAX_ERRORS, MAX_MESSAGE_CHARS, MAX_SOURCE_BYTES, CompileError
from sandbox.owned_lru import OwnedLRU

#: Wall-clock limit of the whole child: start-up, imports and the CPU budget,
#: generous because the host may be busy; the CPU budget is the real limit.
WALL_TIMEOUT_S = 30.0
#: Remembered verdicts: in all, and of one guild (``sandbox.owned_lru``: a
#: guild's saves never push another guild's verdicts out).
VERDICT_CACHE = 4096
VERDICTS_PER_GUILD = 16
#: The compile process's answer is at most `MAX_ERRORS` short errors (the
#: compiler bounds them); anything longer is not believed, nor kept.
MAX_ANSWER_BYTES = 64 * 1024

#: How long past the wall-clock limit the service waits for the compile
#: server's word before it gives up on it.
ANSWER_GRACE_S = 5.0
_FUNCTIONS_RE = re.compile(r"\b(?:def|lambda|class)\b")



@dataclass(frozen=True, slots=True)
class Verdict:
    """What the save-time compile found: nothing (``ok``) or the errors, and the
    save-time checks' warnings (``sandbox.checks``, run in the same process)."""

    errors: tuple[CompileError, ...]
    warnings: tuple[CompileError, ...] = ()

    @property
    def ok(self) -> bool:
        """True when the source compiled within budget."""
        return not self.errors


def new_verdicts() -> OwnedLRU[tuple[str, bytes], Verdict]:
    """An empty store of remembered verdicts."""
    return OwnedLRU(VERDICT_CACHE, VERDICTS_PER_GUILD)


_verdicts = new_verdicts()
_lock = threading.Lock()
log = logging.getLogger("sandbox.compile_gate")
#: Layers a compile process said did not take effect, with the reason (each
#: logged once per service process, as the pool logs its workers' at start).
_inactive: dict[str, str] = {}


def inactive_layers() -> dict[str, str]:
    """The hardening layers the compile processes so far reported inactive."""
    with _lock:
        return dict(_inactive)


#: The layers the compile process reports on (anything else it says is ignored:
#: a process taken over through a parser bug may say anything).
_LAYERS = ("network_namespace", "empty_root", "drop_user", "no_new_privs", "landlock", "seccomp")


def _note_inactive(reported: Any) -> None:
    if not isinstance(reported, dict):
        return
    for layer in _LAYERS:
        why = reported.get(layer)
        if not isinstance(why, str):
            continue
        with _lock:
            new = _inactive.get(layer) != why
            _inactive[layer] = why
        if new:
            log.warning("save-time compile process: layer %s is NOT active: %r", layer,
                        why[:200])


def check_source(text: str, scope: str = "") -> Verdict:
    """Compile ``text`` in a sandboxed process forked for it by the compile server,
    within budget. After a compile of the guild crashed, its saves are refused
    for ``CRASH_COOLDOWN_S`` (each crash retires the server).

    ``scope`` (the guild) keys the remembered verdicts: a save answered at
    once because the same text was saved before would tell one guild what
    another guild's script holds (review, session 25). A verdict that says
    more about the host than the source (the wall-clock limit on a busy host,
    a compile process that could not start or died) is not remembered."""
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    key = (scope, digest)
    with _lock:
        known = _verdicts.get(key)
        if known is not None:
            return known
        left = _crashed.get(scope, 0.0) - time.monotonic()
    if left > 0:
        return Verdict(_failed(f"a compile of this guild's scripts failed; saves are refused "
                               f"for {math.ceil(left)} s more"))
    errors, lasting, warnings = _run_child(text)
    if errors is _CRASHED:
        with _lock:
            now = time.monotonic()
            _crashed[scope] = now + CRASH_COOLDOWN_S
            if len(_crashed) > VERDICT_CACHE:   # cool-downs that ended go first
                for ended in [g for g, until in _crashed.items() if until <= now]:
                    del _crashed[ended]
            while len(_crashed) > VERDICT_CACHE:
                del _crashed[next(iter(_crashed))]
    verdict = Verdict(errors, warnings)
    if lasting:
        with _lock:
            _verdicts.put(scope, key, verdict)
    return verdict


def _too_long(text: str) -> tuple[CompileError, ...]:
    lines = text.count("\n") + 1
    functions = len(_FUNCTIONS_RE.findall(text))
    return (CompileError(1, 1, f"script takes too long to compile: more than "
                               f"{limits.COMPILE_CPU_BUDGET_S:g} s of CPU time ({lines} lines, "
                               f"about {functions} functions, lambdas and classes); make it "
                               "smaller or move data out of the source"),)


def _failed(why: str) -> tuple[CompileError, ...]:
    return (CompileError(1, 1, f"the script could not be compiled ({why})"),)


def _sandbox_ids() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


_server = compile_server.Client()
#: The errors of a compile process that crashed (a signal other than the CPU
#: timer's): it may be a probe of a memory bug in the compiler.
_CRASHED = _failed("compile process failed")
#: After a crash, that guild's saves are refused this long: each crash retires
#: the compile server (a new interpreter for everyone's next compile), and one
#: guild crashing in a loop made every other guild's saves wait for one.
CRASH_COOLDOWN_S = 60.0
_crashed: dict[str, float] = {}


def _run_child(text: str) -> tuple[tuple[CompileError, ...], bool, tuple[CompileError, ...]]:
    """The compile process's verdict, whether it is the source's (lasting), and
    the save-time checks' warnings."""
    uid, gid = _sandbox_ids()
    params = {"cpu": limits.COMPILE_CPU_BUDGET_S, "mem": limits.COMPILE_MEMORY_BYTES,
              "uid": uid, "gid": gid, "wall": WALL_TIMEOUT_S,
              # The nice value of the thread that asks (service.http.priority); where
              # it is below the server's and not root, the server's.
              "nice": os.getpriority(os.PRIO_PROCESS, threading.get_native_id())}
    source = text.encode("utf-8", "surrogatepass")
    if len(source) > MAX_SOURCE_BYTES:   # the compiler's own answer, without a process
        return (CompileError(1, 1, f"source is {len(source)} bytes, over the "
                                   f"{MAX_SOURCE_BYTES}-byte limit"),), True, ()
    try:
        answer, ended = _ask_server(params, source)
    except compile_server.ServerGone as exc:
        return _failed(str(exc)), False, ()
    except TimeoutError:
        return _failed("the compile server did not answer"), False, ()
    except OSError as exc:
        return _failed(f"compile process could not start: {exc.strerror}"), False, ()
    try:
        end = json.loads(ended)
        if end.get("busy"):
            return _failed("too many scripts are being compiled at once; try again"), False, ()
        code, sig, wall = int(end["code"]), int(end["signal"]), bool(end["wall"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return _failed("the compile server did not answer"), False, ()
    if wall:
        return _too_long(text), False, ()
    if sig in (signal.SIGPROF, signal.SIGXCPU):
        return _too_long(text), True, ()
    if code != 0 or sig:
        if sig:
            # A crash may be a probe of a memory bug: the next compile is forked
            # from a new server (new addresses, new stack canary), so retrying
            # learns nothing of this one's layout. The saver is told no more
            # than that it failed.
            _server.retire(WALL_TIMEOUT_S + ANSWER_GRACE_S)
            log.warning("save-time compile process ended with signal %d", sig)
            return _CRASHED, False, ()
        log.warning("save-time compile process ended with exit status %d", code)
        return _failed("compile process failed"), False, ()
    if len(answer) > MAX_ANSWER_BYTES:
        return _failed("compile process answered too much"), False, ()
    try:
        out = json.loads(answer)
        errors = tuple(CompileError(int(e[0]), int(e[1]), str(e[2])[:MAX_MESSAGE_CHARS])
                       for e in out["errors"][:MAX_ERRORS + 1])
        warnings = tuple(CompileError(int(w[0]), int(w[1]), str(w[2])[:MAX_MESSAGE_CHARS])
                         for w in out.get("warnings", ())[:MAX_ERRORS])
        over = bool(out["over"])
    except (ValueError, KeyError, TypeError, IndexError, OverflowError):   # inf as a line
        return _failed("compile process answered nonsense"), False, ()
    _note_inactive(out.get("inactive"))
    if over:
        return (CompileError(1, 1, f"script needs more than "
                                   f"{limits.COMPILE_MEMORY_BYTES >> 20} MB of memory to "
                                   "compile"),), True, ()
    return errors, True, warnings


def _ask_server(params: dict[str, Any], source: bytes) -> tuple[bytes, bytes]:
    """The compile process's answer and the server's word on how it ended."""
    data, data_child = socket.socketpair()
    try:
        status, status_child = socket.socketpair()
    except OSError:
        data.close()
        data_child.close()
        raise
    try:
        try:
            server = _server.request(params, data_child.fileno(), status_child.fileno())
        finally:
            data_child.close()
            status_child.close()
        deadline = time.monotonic() + float(params["wall"]) + ANSWER_GRACE_S
        try:
            answer = _exchange(data, source, deadline)
            data.close()   # a process that writes on past what is believed gets EPIPE
            return answer, _read(status, deadline, 4096, until_eof=True)
        except TimeoutError:
            _server.restart(server)   # wedged: the compiles it runs end with it
            raise
    finally:
        data.close()
        status.close()


def _exchange(sock: socket.socket, source: bytes, deadline: float) -> bytes:
    """Send the source, then read the answer to its end (keeping what may be believed)."""
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    try:
        sock.sendall(source)
        sock.shutdown(socket.SHUT_WR)
    except TimeoutError:
        raise
    except OSError:
        pass   # the process is gone before reading it all: its status says why
    return _read(sock, deadline, MAX_ANSWER_BYTES + 1)


def _read(sock: socket.socket, deadline: float, keep: int, until_eof: bool = False) -> bytes:
    """What arrives by ``deadline`` until EOF, or until more than ``keep`` bytes have
    come (not ``until_eof``: no more is believed, so no more is read)."""
    chunks: list[bytes] = []
    kept = 0
    while True:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return b"".join(chunks)
        if kept < keep:
            chunks.append(chunk[:keep - kept])
            kept += len(chunks[-1])
        elif not until_eof:
            return b"".join(chunks)


# --- the child ---------------------------------------------------------------

def _harden(payload: dict[str, Any]) -> dict[str, str]:
    """Harden this process like a worker; returns the layers that did not take
    effect, with the reason (reported to the service, which logs them)."""
    from sandbox import hardening, seccomp_rules
    inactive: dict[str, str] = {}

    def note(layer: str, result: tuple[bool, str]) -> None:
        if not result[0]:
            inactive[layer] = result[1] or "failed"

    # Before the rlimits: with a file size limit of 0, tempfile finds no
    # directory it can write its probe file into.
    root_fd = hardening.make_empty_root(hardening.HardeningConfig(0))
    os.environ.clear()
    mem = int(payload["mem"])
    # The budget is the profiling timer's (child_main); RLIMIT_CPU is the
    # backstop just past it. Its soft limit is the whole allowance: this
    # process never re-arms it as a worker does (the worker's 2 s window
    # killed compiles between 2 s and the budget as "too long").
    cpu_s = math.ceil(float(payload["cpu"])) + 2
    limits.apply_rlimits(address_space=limits.current_address_space() + 2 * mem
                         + limits.AS_SLACK_BYTES,
                         cpu_lifetime_s=cpu_s, cpu_soft_s=cpu_s, nofile=16)
    if os.geteuid() == 0:
        note("network_namespace", hardening.enter_network_namespace())
        note("empty_root", hardening.enter_empty_root(root_fd))
        note("drop_user", hardening.drop_privileges(int(payload["uid"]), int(payload["gid"])))
        limits.forbid_new_processes()
    else:
        for layer in ("network_namespace", "empty_root", "drop_user"):
            inactive[layer] = f"not started as root (uid {os.geteuid()})"
    if payload.get("parent"):
        # After the uid change, which clears it; seccomp then refuses to unset it.
        hardening.set_parent_death_signal(int(payload["parent"]))
    note("no_new_privs", hardening.set_no_new_privs())
    note("landlock", landlock.apply())   # no file opened from here on (where it is)
    # One process, one filter: libseccomp builds and loads it (no prebuilt program).
    note("seccomp", seccomp_rules.load_seccomp(seccomp_rules.build_seccomp_filter()))
    return inactive


def compile_child(params: dict[str, Any]) -> None:
    """The compile process, forked by the compile server (``sandbox.compile_server``):
    descriptor 0 and 1 are its data socket. Reads the source to its end,
    hardens, compiles within budget, writes the verdict and exits."""
    from sandbox.checks import check_source as run_checks
    from sandbox.compiler import compile_script
    params["parent"] = os.getppid()   # the server: this process dies with it
    try:
        # The nice value of the thread that asked; below the server's own
        # only where that is allowed (as root), so at least the server's.
        os.setpriority(os.PRIO_PROCESS, 0, int(params["nice"]))
    except OSError:
        pass
    chunks: list[bytes] = []
    size = 0
    while size <= MAX_SOURCE_BYTES and (chunk := os.read(0, 1 << 16)):
        chunks.append(chunk)
        size += len(chunk)
    source = b"".join(chunks)[:MAX_SOURCE_BYTES + 1]   # the compiler refuses more
    accountant = limits.make_accountant()
    inactive = _harden(params)
    # Default action of SIGPROF: the process ends, wherever it is.
    signal.setitimer(signal.ITIMER_PROF, float(params["cpu"]))
    guarded = accountant.enforcing  # tracemalloc would slow the compile 8-24x
    if guarded:
        accountant.arm(int(params["mem"]))
    found: list[list[Any]] = []
    try:
        result = compile_script(source)
        if result.ok:
            # The save-time checks (imports, builtins, handlers) parse and walk
            # the source again: here, within the same budget, not in the
            # service (red-team pass, session 34: 1.5 s of the service's CPU
            # a save, holding its GIL up to 0.26 s at a time).
            report = run_checks(source.decode("utf-8", "surrogatepass"))
            errors = [[e.line, e.column, e.message] for e in report.errors[:MAX_ERRORS + 1]]
            found = [[w.line, w.column, w.message] for w in report.warnings[:MAX_ERRORS]]
        else:
            errors = [[e.line, e.column, e.message] for e in result.errors]
    finally:
        over = accountant.disarm()[1] if guarded else False
    signal.setitimer(signal.ITIMER_PROF, 0)
    answer = memoryview(json.dumps({"errors": errors, "warnings": found, "over": over,
                                    "inactive": inactive}).encode())
    while answer:
        answer = answer[os.write(1, answer):]
    os._exit(0)
