"""The OS layer: unrestricted Python inside a real hardened worker still cannot escape.

These tests use the pool's test-only hook (``Pool(_unsafe_test_hooks=True)``,
``pool._test_exec``) which runs plain Python in a worker after hardening.
"""
from __future__ import annotations

import errno
import os
import socket
from typing import Any

import pytest

from sandbox.pool import Pool

from tests.sandbox.poolkit import event, ref, run_with_pool

pytestmark = pytest.mark.timeout(60)

ROOT = os.geteuid() == 0

PROBE = '''
import errno, os, socket
res = {}
def attempt(name, fn):
    try:
        fn()
        res[name] = "allowed"
    except OSError as exc:
        res[name] = exc.errno

attempt("socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
attempt("unix_socket", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
attempt("socketpair", lambda: socket.socketpair())
attempt("open_write", lambda: open("/tmp/sandbox-hardening-probe", "w"))
attempt("open_append", lambda: open("/tmp/sandbox-hardening-probe", "a"))
attempt("open_rdwr", lambda: os.open("/etc/hostname", os.O_RDWR))
attempt("mkdir", lambda: os.mkdir("/tmp/sandbox-hardening-dir"))
attempt("unlink", lambda: os.unlink("/tmp/sandbox-hardening-nothing"))
def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
attempt("fork", fork)
attempt("execv", lambda: os.execv("/bin/true", ["true"]))
attempt("listen_fd", lambda: os.fstat(LISTEN_FD))
res["fds"] = sorted(int(x) for x in os.listdir("/proc/self/fd"))
res["uid"] = os.getuid()
with open("/proc/self/net/dev") as f:
    res["interfaces"] = [line.split(":")[0].strip() for line in f.readlines()[2:]]
with open("/proc/self/status") as f:
    status = dict(line.rstrip("\\n").split(":\\t", 1) for line in f if ":\\t" in line)
res["seccomp"] = status.get("Seccomp", "").strip()
res["nnp"] = status.get("NoNewPrivs", "").strip()
res["environ"] = dict(os.environ)
res["getenv"] = os.getenv("LOGIC_DATABASE_URL")
result = res
'''


def _probe(listen_fd: int) -> dict[str, Any]:
    async def scenario(pool: Pool) -> dict[str, Any]:
        ok, value = await pool._test_exec(PROBE.replace("LISTEN_FD", str(listen_fd)))
        assert ok, value
        assert isinstance(value, dict)
        return value

    return run_with_pool(scenario, size=1, _unsafe_test_hooks=True)  # type: ignore[no-any-return]


def test_hardened_worker_blocks_network_files_processes_and_parent_socket(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # An operator secret in the service's environment must not reach a worker.
    monkeypatch.setenv("LOGIC_DATABASE_URL", "postgresql://logic:hunter2@db/logic")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        res = _probe(listener.fileno())
    finally:
        listener.close()
    assert res["environ"] == {}
    assert res["getenv"] is None
    denied = {errno.EPERM, errno.EACCES}
    for name in ("socket", "unix_socket", "socketpair", "open_write", "open_append",
                 "open_rdwr", "mkdir", "unlink", "fork", "execv"):
        assert res[name] in denied, (name, res[name])
    # The parent's listening socket is not even a descriptor in the worker.
    assert res["listen_fd"] == errno.EBADF
    assert res["fds"][:4] == [0, 1, 2, 3] and len(res["fds"]) <= 5  # + the listdir fd
    assert res["seccomp"] == "2" and res["nnp"] == "1"
    if ROOT:
        assert res["uid"] == 65534
        assert res["interfaces"] == ["lo"]


def test_pool_reports_every_layer_active_on_this_host() -> None:
    async def scenario(pool: Pool) -> None:
        layers = pool.hardening
        for layer in ("close_fds", "rlimits", "no_new_privs", "seccomp", "memguard"):
            assert layers[layer], (layer, pool.hardening_notes)
        if ROOT:
            assert layers["network_namespace"] and layers["drop_user"] and layers["nproc"]

    run_with_pool(scenario, size=1)


def test_disabled_layer_is_reported_not_skipped(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="sandbox.pool")

    async def scenario(pool: Pool) -> None:
        assert pool.hardening["network_namespace"] is False
        assert "disabled" in pool.hardening_notes["network_namespace"]
        out = await pool.run(ref("on endpoint(event):\n    event.reply(1)\n"), event(),
                             __import__("sandbox.pool").pool.Limits(1000, 512))
        assert out.body == b"1"

    run_with_pool(scenario, size=1, network_namespace=False)
    assert any("network_namespace is NOT active" in r.getMessage() for r in caplog.records)


def test_test_hook_is_refused_by_a_worker_started_without_it() -> None:
    async def scenario(pool: Pool) -> None:
        pool._test_hooks = True  # the service side is fooled; the worker still refuses
        out = await pool._test_exec("result = 1")
        assert getattr(out, "error_kind", None) == "crash"

    run_with_pool(scenario, size=1)


def test_operator_check_reads_the_layers_from_proc() -> None:
    from sandbox.check import inspect

    async def scenario(pool: Pool) -> None:
        seen = inspect(pool.worker_pids[0])
        assert seen["no_new_privs"] and seen["seccomp_filter"]
        assert seen["fds"] == [0, 1, 2, 3]
        assert seen["limits"]["Max file size"] == ["0", "0"]
        assert seen["limits"]["Max open files"] == ["16", "16"]
        if ROOT:
            assert seen["uid"] == ["65534"] and seen["own_network_namespace"]

    run_with_pool(scenario, size=1)


@pytest.mark.skipif(not ROOT, reason="a network namespace needs root")
def test_without_seccomp_the_network_namespace_still_blocks_connect() -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    code = f'''
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.settimeout(1)
try:
    s.connect(("127.0.0.1", {port}))
    result = "connected"
except OSError as exc:
    result = exc.errno
'''

    async def scenario(pool: Pool) -> Any:
        assert pool.hardening["seccomp"] is False
        return await pool._test_exec(code)

    try:
        ok, value = run_with_pool(scenario, size=1, seccomp=False, _unsafe_test_hooks=True)
    finally:
        listener.close()
    assert ok and value in (errno.ENETUNREACH, errno.ECONNREFUSED, errno.EADDRNOTAVAIL), value


def test_a_worker_cannot_signal_its_siblings() -> None:
    async def scenario(pool: Pool) -> None:
        pids = pool.worker_pids
        code = f'''
import errno, os, signal
res = {{}}
for name, fn in (("kill", lambda: os.kill({pids[1]}, signal.SIGKILL)),
                 ("kill_group", lambda: os.kill(0, signal.SIGKILL)),
                 ("kill_all", lambda: os.kill(-1, signal.SIGKILL)),
                 ("self", lambda: os.kill(os.getpid(), 0))):
    try:
        fn()
        res[name] = "allowed"
    except OSError as exc:
        res[name] = exc.errno
result = res
'''
        worker = next(w for w in pool._workers.values() if w is not None and w.pid == pids[0])
        pool._idle.remove(worker)
        pool._idle.append(worker)  # the hook takes the most recently idle worker
        ok, res = await pool._test_exec(code)
        assert ok, res
        assert res == {"kill": errno.EPERM, "kill_group": errno.EPERM, "kill_all": errno.EPERM,
                       "self": "allowed"}
        assert pids[1] in pool.worker_pids

    run_with_pool(scenario, size=2, _unsafe_test_hooks=True)


def test_operator_check_also_runs_the_save_time_compile_process() -> None:
    import json
    import subprocess
    import sys
    root = __file__.rsplit("/tests/", 1)[0]
    proc = subprocess.run([sys.executable, "-m", "sandbox.check"], cwd=root,
                          capture_output=True, text=True, timeout=120, check=False)
    report = json.loads(proc.stdout)
    assert report["compile_gate"] == {"ok": True, "errors": []}
    assert proc.returncode == (0 if all(report["reported"].values()) else 1)


def _netns(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


@pytest.mark.skipif(not ROOT, reason="a network namespace needs root")
def test_workers_start_in_the_fork_servers_empty_network_namespace() -> None:
    """The namespace is entered once, in the fork server: every worker is in it (not
    the service's), and it has only `lo`, so the layer still holds per worker."""
    async def scenario(pool: Pool) -> None:
        pids = pool.worker_pids
        assert len(pids) >= 2
        spaces = {_netns(pid) for pid in pids}
        assert len(spaces) == 1 and _netns(os.getpid()) not in spaces
        assert spaces == {_netns(pool._zygote_pid)}
        ok, res = await pool._test_exec(PROBE.replace("LISTEN_FD", "99"))
        assert ok and res["interfaces"] == ["lo"] and res["socket"] == errno.EPERM, res
        assert pool.hardening["network_namespace"]
        steps = pool.spawn_steps
        assert steps["n"] >= 2 and steps["harden"] > 0 and steps["total"] >= steps["harden"]

    run_with_pool(scenario, size=2, _unsafe_test_hooks=True)


@pytest.mark.skipif(not ROOT, reason="a network namespace needs root")
def test_without_seccomp_each_worker_keeps_its_own_network_namespace() -> None:
    """Without seccomp a worker could create a socket, so workers must not share one
    namespace (two of them could meet through an abstract Unix socket)."""
    async def scenario(pool: Pool) -> None:
        pids = pool.worker_pids
        assert len(pids) >= 2
        spaces = {_netns(pid) for pid in pids}
        assert len(spaces) == len(pids) and _netns(os.getpid()) not in spaces
        assert _netns(pool._zygote_pid) == _netns(os.getpid())
        assert pool.hardening["network_namespace"]

    run_with_pool(scenario, size=2, seccomp=False)
