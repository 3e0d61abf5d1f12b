"""The save-time compile processes are forked from a compile server: a fresh
interpreter with nothing of the service in it, whose children hold nothing but
their own compile's socket and run at the nice value of the thread that asked."""
from __future__ import annotations

import os
import signal
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from sandbox import compile_gate, compile_server
from service.http.priority import background_executor
from tests.factories import large_source

SOURCE = "on endpoint(event):\n    event.reply('ok')\n"


def _slow_source(tag: str) -> str:
    # ~250 KB of ordinary functions: 0.5-2 s of CPU, time to look at the process.
    return large_source(tag + "_", 840)


def _server_pid() -> int:
    compile_gate.check_source(SOURCE, scope=f"warm-{time.monotonic_ns()}")
    proc = compile_gate._server._proc
    assert proc is not None and proc.poll() is None
    return proc.pid


def _children(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                found.append(int(entry))
    return found


def _look_at(pid: int) -> dict[str, Any] | None:
    """Nice value and open descriptors of a running compile process (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            nice = int(fh.read().rsplit(")", 1)[1].split()[16])
        fds = {int(fd): os.stat(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    except OSError:
        return None
    return {"nice": nice, "fds": fds}


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def _dead(pid: int) -> bool:
    try:
        return _state(pid) in ("Z", "X")
    except OSError:
        return True


def test_the_server_is_a_fresh_interpreter_with_an_empty_environment() -> None:
    pid = _server_pid()
    assert pid != os.getpid()
    with open(f"/proc/{pid}/environ", "rb") as fh:
        assert fh.read() == b""
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        argv = fh.read().split(b"\0")
    assert argv[1:3] == [b"-I", b"-c"]   # isolated mode: no PYTHON* variables, no user site


@pytest.mark.skipif(os.getpriority(os.PRIO_PROCESS, 0) != 0, reason="the test runs niced already")
def test_a_compile_process_holds_only_its_own_socket_and_runs_at_the_callers_nice() -> None:
    server = _server_pid()
    seen: dict[int, dict[str, Any]] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for child in _children(server):
                look = _look_at(child)
                if look is not None and look["fds"]:
                    seen[child] = look   # the last look: while it compiles
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    niced = background_executor(1, "compile-test")   # nice 10, as the admin API's threads
    plain = ThreadPoolExecutor(1)
    try:
        # Two compiles at once: when the second is forked, the server holds the
        # first one's sockets.
        first = plain.submit(compile_gate.check_source, _slow_source("a"), "g1")
        time.sleep(0.05)
        second = niced.submit(compile_gate.check_source, _slow_source("b"), "g2")
        assert first.result(timeout=120).ok and second.result(timeout=120).ok
    finally:
        done.set()
        watcher.join()
        niced.shutdown()
        plain.shutdown()
    assert len(seen) == 2, seen
    assert sorted(look["nice"] for look in seen.values()) == [0, 10]
    for look in seen.values():
        fds = look["fds"]
        sockets = {fd for fd, st in fds.items() if stat.S_ISSOCK(st.st_mode)}
        assert sockets == {0, 1}, fds                # its own data socket, nothing else
        assert (fds[0].st_ino, fds[0].st_dev) == (fds[1].st_ino, fds[1].st_dev)


def _kill_its_compile(server: int) -> list[int]:
    killed: list[int] = []

    def kill_it() -> None:
        deadline = time.monotonic() + 30
        while not killed and time.monotonic() < deadline:
            for child in _children(server):
                os.kill(child, signal.SIGKILL)
                killed.append(child)
            time.sleep(0.002)

    killer = threading.Thread(target=kill_it)
    killer.start()
    return killed


def test_a_crashed_compile_is_not_remembered_and_the_next_comes_from_a_new_server(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A crash may be a probe of a memory bug in the compiler: compiles forked
    # from one server share its addresses and stack canary, so the next one is
    # forked from a new server, and the saver learns nothing of how it died
    # (review, session 27). The guild's saves then wait a while: one guild
    # crashing in a loop made every guild's saves wait for a new server.
    monkeypatch.setattr(compile_gate, "CRASH_COOLDOWN_S", 1.5)
    server = _server_pid()
    killed = _kill_its_compile(server)
    source = _slow_source("k")
    verdict = compile_gate.check_source(source, scope="killed")
    assert killed
    assert [e.message for e in verdict.errors] == [
        "the script could not be compiled (compile process failed)"]
    refused = compile_gate.check_source("v = 1\n" + SOURCE, scope="killed")
    assert refused.errors[0].message.startswith(
        "the script could not be compiled (a compile of this guild's scripts failed; saves "
        "are refused for ")
    assert compile_gate.check_source("v = 1\n" + SOURCE, scope="another guild").ok
    assert compile_gate._server._proc is not None and compile_gate._server._proc.pid != server
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not _dead(server):   # the old one exits
        time.sleep(0.01)
    assert _dead(server)
    time.sleep(1.6)
    assert compile_gate.check_source(source, scope="killed").ok   # compiled again, not remembered


def test_a_wedged_retired_server_is_killed_not_the_current_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Second pass of the review: a compile that timed out on a retired server
    # made the service kill the current one (failing another guild's compile),
    # and the wedged retired server lived on.
    monkeypatch.setattr(compile_gate, "WALL_TIMEOUT_S", 2.0)
    monkeypatch.setattr(compile_gate, "ANSWER_GRACE_S", 1.0)
    old = _server_pid()
    with ThreadPoolExecutor(2) as pool:
        stuck = pool.submit(compile_gate.check_source, _slow_source("w"), "stuck")
        deadline = time.monotonic() + 10
        while not _children(old) and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(old, signal.SIGSTOP)              # wedged, with a compile in it
        compile_gate._server.retire(30.0)         # as after a crash elsewhere
        current = _server_pid()
        assert current != old
        # A small source: the lowered wall-clock limit must not end it on a busy host.
        later = pool.submit(compile_gate.check_source, "x = 5\n" + SOURCE, "later")
        assert not stuck.result(timeout=60).ok      # "did not answer": the old one is killed
        assert later.result(timeout=60).ok          # the current one served on
    assert _dead(old)
    assert compile_gate._server._proc is not None and compile_gate._server._proc.pid == current


def test_a_compile_dies_with_its_server() -> None:
    # The server enforces the wall-clock limit: a compile that outlived it
    # would have none (review, session 27). The compile is stopped, so it
    # cannot end by itself; its server's death must end it.
    server = _server_pid()
    seen: list[int] = []
    done = threading.Event()

    def kill_server() -> None:
        while not done.is_set() and not seen:
            seen.extend(_children(server))
            time.sleep(0.002)
        if seen:
            time.sleep(0.1)   # well into its compile, hardened
            for pid in seen:
                os.kill(pid, signal.SIGSTOP)
            os.kill(server, signal.SIGKILL)

    killer = threading.Thread(target=kill_server)
    killer.start()
    verdict = compile_gate.check_source(_slow_source("d"), scope="orphan")
    done.set()
    killer.join()
    try:
        assert seen and not verdict.ok
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(_dead(pid) for pid in seen):
            time.sleep(0.01)
        assert all(_dead(pid) for pid in seen), seen
    finally:
        for pid in seen:
            if not _dead(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_server_answers_busy_past_its_compiles_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_gate, "_server", compile_server.Client(max_running=1))
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(compile_gate.check_source, _slow_source("b1"), "busy1")
        time.sleep(0.3)
        second = pool.submit(compile_gate.check_source, "z = 1\n" + SOURCE, "busy2")
        assert [e.message for e in second.result(timeout=60).errors] == [
            "the script could not be compiled (too many scripts are being compiled at once; "
            "try again)"]
        assert first.result(timeout=60).ok
    assert compile_gate.check_source("z = 1\n" + SOURCE, "busy2").ok   # not remembered


def test_a_source_over_the_limit_starts_no_compile() -> None:
    calls_before = _server_pid()
    verdict = compile_gate.check_source("# " + "x" * 300_000 + "\n" + SOURCE, scope="huge")
    assert [e.message for e in verdict.errors] == [
        "source is 300045 bytes, over the 262144-byte limit"]
    assert compile_gate._server._proc is not None and compile_gate._server._proc.pid == calls_before


def test_a_forked_service_starts_its_own_server_and_leaves_the_parents() -> None:
    server = _server_pid()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the forked child
        try:
            ok = compile_gate.check_source("w = 3\n" + SOURCE, scope="forked").ok
            proc = compile_gate._server._proc
            os.write(write, f"{ok} {proc.pid if proc else 0}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as fh:
        ok, child_server = fh.read().split()
    os.waitpid(pid, 0)
    assert ok == "True" and int(child_server) not in (0, server)
    assert _state(server) != "Z" and compile_gate.check_source("w = 4\n" + SOURCE, "p").ok


def test_a_server_that_died_is_started_again() -> None:
    server = _server_pid()
    os.kill(server, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _state(server) != "Z":   # dead, not yet waited for
        time.sleep(0.01)
    assert compile_gate.check_source("x = 1\n" + SOURCE, scope="again").ok
    assert compile_gate._server._proc is not None and compile_gate._server._proc.pid != server


def test_a_wedged_server_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    server = _server_pid()
    monkeypatch.setattr(compile_gate, "WALL_TIMEOUT_S", 2.0)
    monkeypatch.setattr(compile_gate, "ANSWER_GRACE_S", 1.0)
    os.kill(server, signal.SIGSTOP)
    try:
        verdict = compile_gate.check_source("y = 2\n" + SOURCE, scope="wedged")
    finally:
        try:
            os.kill(server, signal.SIGCONT)
        except ProcessLookupError:
            pass   # replaced: killed and waited for
    assert [e.message for e in verdict.errors] == [
        "the script could not be compiled (the compile server did not answer)"]
    assert compile_gate.check_source("y = 2\n" + SOURCE, scope="wedged").ok
    assert compile_gate._server._proc is not None and compile_gate._server._proc.pid != server
