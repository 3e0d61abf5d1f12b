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

from sandbox import compile_gate
from service.http.priority import background_executor

SOURCE = "on endpoint(event):\n    event.reply('ok')\n"


def _slow_source(tag: str) -> str:
    # ~250 KB of ordinary functions: 0.5-2 s of CPU, time to look at the process.
    block = (f"def handler_{tag}_{{i}}(event, data):\n    total = 0\n"
             "    for item in data.get('items', []):\n"
             "        if item.get('price', 0) > 10:\n"
             "            total += item['price'] * item.get('qty', 1)\n"
             "        else:\n            total -= 1\n"
             "    result = {{'total': total, 'name': 'handler_{i}', 'ok': total > 0}}\n"
             "    return result\n\n")
    return "".join(block.format(i=i) for i in range(840)) + SOURCE


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


def test_a_killed_compile_is_not_remembered_and_the_server_serves_on() -> None:
    server = _server_pid()
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
    source = _slow_source("k")
    verdict = compile_gate.check_source(source, scope="killed")
    killer.join()
    assert killed
    assert [e.message for e in verdict.errors] == [
        "the script could not be compiled (compile process exited with -9)"]
    assert compile_gate.check_source(source, scope="killed").ok   # compiled again, not remembered
    assert compile_gate._server._proc is not None and compile_gate._server._proc.pid == server


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
