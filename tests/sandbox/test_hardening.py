"""The OS layer: unrestricted Python inside a real hardened worker still cannot escape.

These tests use the pool's test-only hook (``Pool(_unsafe_test_hooks=True)``,
``pool._test_exec``) which runs plain Python in a worker after hardening.
"""
from __future__ import annotations

import asyncio
import errno
import os
import socket
from typing import Any

import pytest

from sandbox.pool import Pool

from tests.sandbox.poolkit import alive, event, exec_seen, ref, run_with_pool

pytestmark = pytest.mark.timeout(60)

ROOT = os.geteuid() == 0

#: The start of a probe: `res` and `attempt(name, fn)`, which records "allowed"
#: or the errno a call raised.
ATTEMPT = '''
import errno, os, socket
res = {}
def attempt(name, fn):
    try:
        fn()
        res[name] = "allowed"
    except OSError as exc:
        res[name] = exc.errno
'''

PROBE = ATTEMPT + '''
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
attempt("statvfs", lambda: os.statvfs("/"))
attempt("fstatvfs", lambda: os.fstatvfs(0))
res["pid"] = os.getpid()
res["uid"] = os.getuid()
res["environ"] = dict(os.environ)
res["getenv"] = os.getenv("LOGIC_DATABASE_URL")
result = res
'''


def _probe(listen_fd: int) -> dict[str, Any]:
    async def scenario(pool: Pool) -> dict[str, Any]:
        ok, value, outside = await exec_seen(pool, PROBE.replace("LISTEN_FD", str(listen_fd)))
        assert ok, value
        assert isinstance(value, dict)
        return {**value, "outside": outside}

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
    # A file system's free space moves with other guilds' traffic (the
    # database's disk): statfs and fstatfs are refused outright.
    assert res["statvfs"] == errno.EPERM and res["fstatvfs"] == errno.EPERM, res
    # The parent's listening socket is not even a descriptor in the worker.
    assert res["listen_fd"] == errno.EBADF
    outside = res["outside"]
    assert outside["status"]["Seccomp"] == "2" and outside["status"]["NoNewPrivs"] == "1"
    if ROOT:
        # Past the channel and /dev/null only the worker's own statm (opened
        # before Landlock; see sandbox/landlock.py).
        assert outside["fds"] == [0, 1, 2, 3, 4]
        assert outside["fd_targets"] == [f"/proc/{res['pid']}/statm"], outside["fd_targets"]
        assert res["uid"] == 65534
        assert outside["interfaces"] == ["lo"]


def test_pool_reports_every_layer_active_on_this_host() -> None:
    async def scenario(pool: Pool) -> None:
        layers = pool.hardening
        for layer in ("close_fds", "rlimits", "no_new_privs", "seccomp", "memguard"):
            assert layers[layer], (layer, pool.hardening_notes)
        if ROOT:
            assert layers["network_namespace"] and layers["drop_user"] and layers["nproc"]
        from sandbox import landlock
        assert layers["landlock"] is (landlock.abi_version() > 0), pool.hardening_notes

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
        pid = pool.worker_pids[0]
        if ROOT:   # (a non-root reader cannot list an undumpable worker's descriptors)
            assert seen["fds"] == [0, 1, 2, 3, 4]
            assert seen["fd_targets"] == [f"/proc/{pid}/statm"]
        assert seen["limits"]["Max file size"] == ["0", "0"]
        assert seen["limits"]["Max open files"] == ["16", "16"]
        if ROOT:
            assert seen["uid"] == ["65534"] and seen["own_network_namespace"]

    run_with_pool(scenario, size=1)


THREAD_PROBE = ATTEMPT + '''
import threading
def thread():
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
try:
    thread()
    res["thread"] = "allowed"
except RuntimeError as exc:   # "can't start new thread": pthread_create's EAGAIN
    res["thread"] = str(exc)
def fork():
    if os.fork() == 0:
        os._exit(0)
attempt("fork", fork)
res["pid"] = os.getpid()
result = res
'''


def _max_processes(pid: int) -> list[str]:
    with open(f"/proc/{pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max processes"))
    return line[len("Max processes"):].split()[:2]


@pytest.mark.parametrize("seccomp", [True, False])
def test_a_worker_can_start_no_thread_and_no_process(seccomp: bool) -> None:
    """docs/security-workers.md, layer 6: RLIMIT_NPROC 0. The seccomp filter
    lets clone() with CLONE_THREAD through, so the limit alone keeps a
    compromised worker from starting threads (without the filter, processes
    too: EAGAIN, the limit's answer, where the filter answers EPERM)."""
    async def scenario(pool: Pool) -> tuple[list[str], dict[str, Any]]:
        limit = _max_processes(pool.worker_pids[0])
        ok, res, _ = await exec_seen(pool, THREAD_PROBE)
        assert ok, res
        return limit, res

    limit, res = run_with_pool(scenario, size=1, _unsafe_test_hooks=True, seccomp=seccomp)
    assert res["thread"] == "can't start new thread", res
    assert res["fork"] == (errno.EPERM if seccomp else errno.EAGAIN), res
    assert limit == ["0", "0"], limit


DUMPABLE_PROBE = '''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
result = {"dumpable": libc.prctl(3, 0, 0, 0, 0), "uid": os.getuid(), "pid": os.getpid()}
'''


def test_a_worker_that_keeps_the_services_uid_is_undumpable() -> None:
    """R7: without a uid change (a service that is not root, or `drop_user`
    off) the workers and the service share a uid, and a dumpable worker's
    /proc/<pid>/mem and environ are open to a compromised sibling. A uid
    change clears the flag by itself, so this needs the drop off."""
    async def scenario(pool: Pool) -> dict[str, Any]:
        ok, res, _ = await exec_seen(pool, DUMPABLE_PROBE)
        assert ok, res
        return res  # type: ignore[no-any-return]

    res = run_with_pool(scenario, size=1, _unsafe_test_hooks=True, drop_user=False)
    assert res["uid"] == os.getuid()   # the uid drop really was off
    assert res["dumpable"] == 0, res


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
        # Landlock off too: it refuses TCP connect (EACCES) before the namespace is reached.
        ok, value = run_with_pool(scenario, size=1, seccomp=False, landlock=False,
                                  _unsafe_test_hooks=True)
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
        ok, res, _ = await exec_seen(pool, code)   # in pids[0]
        assert ok, res
        assert res == {"kill": errno.EPERM, "kill_group": errno.EPERM, "kill_all": errno.EPERM,
                       "self": "allowed"}
        assert pids[1] in pool.worker_pids

    run_with_pool(scenario, size=2, _unsafe_test_hooks=True)


def test_a_worker_cannot_have_the_kernel_signal_its_siblings() -> None:
    # Security review, session 16: a pipe owned by a sibling's pid, with
    # SIGKILL as its I/O signal and O_ASYNC set, made the kernel kill the
    # sibling on the next write; the signal calls' own rules never saw it.
    async def scenario(pool: Pool) -> None:
        pids = pool.worker_pids
        code = f'''
import errno, fcntl, os, signal, struct
res = {{}}
r, w = os.pipe()
steps = (("setown", lambda: fcntl.fcntl(r, fcntl.F_SETOWN, {pids[1]})),
         ("setown_ex", lambda: fcntl.fcntl(r, 15, struct.pack("ii", 1, {pids[1]}))),
         ("setsig", lambda: fcntl.fcntl(r, 10, signal.SIGKILL)),
         ("setlease", lambda: fcntl.fcntl(r, 1024, fcntl.F_RDLCK)),
         ("notify", lambda: fcntl.fcntl(r, 1026, 0)),
         ("fiosetown", lambda: fcntl.ioctl(r, 0x8901, struct.pack("i", {pids[1]}))),
         ("siocspgrp", lambda: fcntl.ioctl(r, 0x8902, struct.pack("i", {pids[1]}))),
         ("fioasync", lambda: fcntl.ioctl(r, 0x5452, struct.pack("i", 1))))
for name, fn in steps:
    try:
        fn()
        res[name] = "allowed"
    except OSError as exc:
        res[name] = exc.errno
# What would have fired the signal: still allowed, and harmless now.
fcntl.fcntl(r, fcntl.F_SETFL, fcntl.fcntl(r, fcntl.F_GETFL) | os.O_ASYNC)
os.write(w, b"x")
res["owner"] = fcntl.fcntl(r, fcntl.F_GETOWN)
result = res
'''
        ok, res, _ = await exec_seen(pool, code)
        assert ok, res
        assert res == {"setown": errno.EPERM, "setown_ex": errno.EPERM, "setsig": errno.EPERM,
                       "setlease": errno.EPERM, "notify": errno.EPERM,
                       "fiosetown": errno.EPERM, "siocspgrp": errno.EPERM,
                       "fioasync": errno.EPERM, "owner": 0}
        await asyncio.sleep(0.2)
        assert pids[1] in pool.worker_pids and alive(pids[1])

    run_with_pool(scenario, size=2, _unsafe_test_hooks=True)


def test_a_worker_opens_no_file(tmp_path: Any) -> None:
    # Security review, session 16: a compromised worker read the service's
    # /proc/<pid>/cmdline (a --database-url with its password) and
    # /proc/<pid>/net/tcp (every caller's address), and whatever else its
    # uid may read - the database itself when the service is not root.
    from sandbox import landlock
    readable = tmp_path / "world-readable.txt"
    readable.write_text("operator data")
    readable.chmod(0o644)
    tmp_path.chmod(0o755)

    async def scenario(pool: Pool) -> dict[str, Any]:
        pids = pool.worker_pids
        code = ATTEMPT + f'''
for name, path in (("service_cmdline", "/proc/{os.getpid()}/cmdline"),
                   ("service_net_tcp", "/proc/{os.getpid()}/net/tcp"),
                   ("sibling_status", "/proc/{pids[1]}/status"),
                   ("etc_passwd", "/etc/passwd"),
                   ("world_readable", "{readable}"),
                   ("python_stdlib", os.__file__)):
    attempt(name, lambda path=path: open(path, "rb").close())
attempt("list_proc", lambda: os.listdir("/proc"))
attempt("list_tmp", lambda: os.listdir("{tmp_path}"))
attempt("own_status", lambda: open("/proc/self/status", "rb").close())
attempt("own_net_tcp", lambda: open("/proc/self/net/tcp", "rb").close())
attempt("own_fds", lambda: os.listdir("/proc/self/fd"))
result = res
'''
        ok, res, _ = await exec_seen(pool, code)
        assert ok, res
        return {"probe": res, "layer": pool.hardening["landlock"],
                "note": pool.hardening_notes.get("landlock", "")}

    # The empty root (chroot) would refuse these paths too: off, so only
    # Landlock stands between the worker and the files.
    seen = run_with_pool(scenario, size=2, _unsafe_test_hooks=True, empty_root=False)
    if landlock.abi_version() == 0:
        # A kernel without Landlock: the layer says so instead of pretending.
        assert seen["layer"] is False and "Landlock unavailable" in seen["note"]
        return
    assert seen["layer"] is True
    assert seen["probe"] == {"service_cmdline": errno.EACCES, "service_net_tcp": errno.EACCES,
                             "sibling_status": errno.EACCES, "etc_passwd": errno.EACCES,
                             "world_readable": errno.EACCES, "python_stdlib": errno.EACCES,
                             "list_proc": errno.EACCES, "list_tmp": errno.EACCES,
                             "own_status": errno.EACCES, "own_net_tcp": errno.EACCES,
                             "own_fds": errno.EACCES}, seen["probe"]


def test_landlock_alone_refuses_tcp_abstract_sockets_and_signals_to_siblings() -> None:
    # What docs/security-workers.md says layer 8 does beyond files, with the
    # seccomp filter and the network namespace off so that only Landlock can
    # refuse (without it all three reach the test's listeners and the sibling).
    from sandbox import landlock
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind(b"\0logic-landlock-probe-%d" % os.getpid())
    abstract.listen()

    async def scenario(pool: Pool) -> Any:
        assert pool.hardening["seccomp"] is False
        pids = pool.worker_pids
        code = ATTEMPT + f'''
def tcp():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(1)
    s.connect(("127.0.0.1", {listener.getsockname()[1]}))
def unix():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1)
    s.connect({abstract.getsockname()!r})
attempt("tcp", tcp)
attempt("abstract", unix)
attempt("signal", lambda: os.kill({pids[1]}, 0))
result = res
'''
        ok, res, _ = await exec_seen(pool, code)
        assert ok, res
        return res

    try:
        res = run_with_pool(scenario, size=2, seccomp=False, network_namespace=False,
                            _unsafe_test_hooks=True)
    finally:
        listener.close()
        abstract.close()
    if landlock.ABI >= 4:
        assert res["tcp"] == errno.EACCES, res
    if landlock.ABI >= 6:
        assert res["abstract"] == errno.EPERM and res["signal"] == errno.EPERM, res


def test_operator_check_also_runs_the_save_time_compile_process() -> None:
    import json
    import subprocess
    import sys
    root = __file__.rsplit("/tests/", 1)[0]
    proc = subprocess.run([sys.executable, "-m", "sandbox.check"], cwd=root,
                          capture_output=True, text=True, timeout=120, check=False)
    report = json.loads(proc.stdout)
    gate = report["compile_gate"]
    assert gate["ok"] is True and gate["errors"] == []
    # The compile process reports the layers it lacks, as the workers do (it
    # misses none of theirs but may miss the same ones).
    missing = {layer for layer, on in report["reported"].items() if not on}
    assert set(gate["inactive"]) <= missing, (gate, missing)
    assert proc.returncode == (0 if not missing and not gate["inactive"] else 1)


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
        ok, res, outside = await exec_seen(pool, PROBE.replace("LISTEN_FD", "99"))
        assert ok and res["socket"] == errno.EPERM, res
        assert outside["interfaces"] == ["lo"]
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


@pytest.mark.skipif(not ROOT, reason="the shared network namespace needs root")
def test_a_worker_in_the_shared_namespace_whose_seccomp_fails_never_serves(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Security review V4: workers share the fork server's namespaces only because
    seccomp refuses sockets and IPC there; a worker whose filter did not load must
    exit before it is ready, so the pool never serves (it does not start)."""
    from sandbox import hardening
    from sandbox.errors import SpawnError
    caplog.set_level("ERROR", logger="sandbox.pool")
    monkeypatch.setattr(hardening, "load_seccomp",
                        lambda flt: (False, "refused by the test"))
    # fresh_interpreter=False: the fork server (and so every worker) is a fork of
    # this process and keeps the patch.
    pool = Pool(size=1, spawn_timeout_s=30.0, fresh_interpreter=False, code_cache_mb=0)
    with pytest.raises(SpawnError):
        pool.start()   # at the first such exit, not after the spawn timeout
    assert any("seccomp filter did not load" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(not ROOT, reason="a network namespace needs root")
def test_a_worker_in_its_own_namespace_without_a_filter_serves_and_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The other side of V4: with no filter to load (libseccomp missing) each worker
    has namespaces of its own, so it serves, with the seccomp layer reported inactive."""
    from sandbox import seccomp_rules
    monkeypatch.setattr(seccomp_rules, "build_seccomp_filter", lambda: None)

    async def scenario(pool: Pool) -> None:
        assert pool.hardening["seccomp"] is False and pool.hardening["network_namespace"]
        pids = pool.worker_pids
        assert len({_netns(pid) for pid in pids}) == len(pids)
        out = await pool.run(ref("on endpoint(event):\n    event.reply(1)\n"), event(),
                             __import__("sandbox.pool").pool.Limits(1000, 512))
        assert out.body == b"1"

    run_with_pool(scenario, size=2, fresh_interpreter=False, code_cache_mb=0)


@pytest.mark.skipif(not ROOT, reason="a worker's /proc/<pid>/environ is readable by root only")
def test_no_worker_holds_the_service_environment_when_the_fork_server_is_a_fork(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """R6 where it matters most: a fork server that is a fork of the service (no
    exec) starts with the service's exec-time environment block and os.environ.
    It clears both once, before its first fork, so no worker holds any of it."""
    monkeypatch.setenv("LOGIC_DATABASE_URL", "postgresql://logic:hunter2@db/logic")
    with open(f"/proc/{os.getpid()}/environ", "rb") as f:
        assert any(f.read())   # this process has one, which the fork server copies

    async def scenario(pool: Pool) -> tuple[bool, Any, dict[str, Any]]:
        return await exec_seen(pool, "import os\nresult = [dict(os.environ), "
                                     "os.getenv('LOGIC_DATABASE_URL')]")

    ok, value, outside = run_with_pool(scenario, size=1, fresh_interpreter=False,
                                       _unsafe_test_hooks=True, code_cache_mb=0)
    assert ok and value == [{}, None]
    assert outside["environ_block"] is not None and not any(outside["environ_block"])


IPC_PROBE = '''
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
try:
    mq_open = libc.mq_open
    mq_unlink = libc.mq_unlink
except AttributeError:
    rt = ctypes.CDLL("librt.so.1", use_errno=True)
    mq_open, mq_unlink = rt.mq_open, rt.mq_unlink
IPC_CREAT, IPC_RMID, KEY = 0o1000, 0, IPC_KEY
res = {}
def attempt(name, fn, cleanup):
    ctypes.set_errno(0)
    value = fn()
    if value == -1:
        res[name] = ctypes.get_errno()
    else:
        res[name] = "allowed"
        cleanup(value)
attempt("shmget", lambda: libc.shmget(KEY, 8 << 20, IPC_CREAT | 0o600),
        lambda i: res.update(shmid=i) if KEEP_SHM else libc.shmctl(i, IPC_RMID, None))
attempt("msgget", lambda: libc.msgget(KEY, IPC_CREAT | 0o600),
        lambda i: libc.msgctl(i, IPC_RMID, None))
attempt("semget", lambda: libc.semget(KEY, 1, IPC_CREAT | 0o600),
        lambda i: libc.semctl(i, 0, IPC_RMID))
attempt("mq_open", lambda: mq_open(b"/logic-ipc-probe", os.O_CREAT | os.O_RDWR, 0o600, None),
        lambda i: (os.close(i), mq_unlink(b"/logic-ipc-probe")))
# Calls on IPC objects (no object exists: the kernel would say EINVAL, EBADF or
# ENOENT; the filter says EPERM before it looks).
buf = ctypes.create_string_buffer(64)
calls = {}
for name, args in (("shmat", (-1, None, 0)), ("shmdt", (None,)), ("shmctl", (-1, 2, buf)),
                   ("msgsnd", (-1, buf, 0, 0o4000)), ("msgrcv", (-1, buf, 0, 0, 0o4000)),
                   ("msgctl", (-1, 2, buf)), ("semop", (-1, buf, 1)),
                   ("semtimedop", (-1, buf, 1, None)), ("semctl", (-1, 0, 2)),
                   ("mq_unlink", (b"/logic-no-such-queue",)),
                   ("mq_timedsend", (-1, buf, 0, 0, None)),
                   ("mq_timedreceive", (-1, buf, 64, None, None)), ("mq_notify", (-1, None)),
                   ("mq_getattr", (-1, buf))):
    ctypes.set_errno(0)
    calls[name] = getattr(libc, name)(*args) == -1 and ctypes.get_errno()
res["calls"] = calls
result = res
'''


def _ipcns(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/ipc").st_ino


def _host_shm_keys() -> set[int]:
    with open("/proc/sysvipc/shm") as f:
        return {int(line.split()[0]) for line in f.readlines()[1:] if line.strip()}


def test_a_hardened_worker_cannot_create_ipc_objects() -> None:
    """Security review V5: System V shared memory, message queues, semaphores and
    POSIX message queues are refused (EPERM), and the worker's IPC namespace is
    not the host's."""
    async def scenario(pool: Pool) -> dict[str, Any]:
        # Its namespace read from outside (the worker's own /proc is out of its reach).
        ns = _ipcns(pool.worker_pids[0]) if ROOT else None
        ok, res = await pool._test_exec(IPC_PROBE.replace("IPC_KEY", "0x10C1C5")
                                        .replace("KEEP_SHM", "False"))
        assert ok, res
        assert isinstance(res, dict)
        return {**res, "ipc_ns": ns}

    res = run_with_pool(scenario, size=1, _unsafe_test_hooks=True)
    assert {name: res[name] for name in ("shmget", "msgget", "semget", "mq_open")} == \
        dict.fromkeys(("shmget", "msgget", "semget", "mq_open"), errno.EPERM), res
    # (glibc's mq_unlink reports EPERM as EACCES; without the filter it is ENOENT.)
    assert res["calls"] == {**dict.fromkeys(res["calls"], errno.EPERM),
                            "mq_unlink": errno.EACCES} and len(res["calls"]) == 14, res
    if ROOT:
        assert res["ipc_ns"] != _ipcns(os.getpid())


@pytest.mark.skipif(not ROOT, reason="an IPC namespace needs root")
def test_without_seccomp_ipc_objects_stay_in_the_workers_own_namespace() -> None:
    """Security review V5: without the filter a worker can create a segment, but in
    an IPC namespace of its own (none shared with a sibling or the host): the host
    never sees it, and it goes with the worker."""
    import random
    key = random.randrange(1 << 20, 1 << 30)

    async def scenario(pool: Pool) -> dict[str, Any]:
        pids = pool.worker_pids
        spaces = {_ipcns(pid) for pid in pids}
        assert len(spaces) == len(pids) >= 2 and _ipcns(os.getpid()) not in spaces
        ok, res = await pool._test_exec(IPC_PROBE.replace("IPC_KEY", str(key))
                                        .replace("KEEP_SHM", "True"))
        assert ok, res
        assert isinstance(res, dict)
        return res

    try:
        res = run_with_pool(scenario, size=2, seccomp=False, _unsafe_test_hooks=True)
        assert res["shmget"] == "allowed", res   # no filter: the call itself works
        assert key not in _host_shm_keys()
    finally:
        # Had it reached the host's namespace, do not leave 8 MiB behind.
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
        shmid = libc.shmget(key, 0, 0)
        if shmid != -1:
            libc.shmctl(shmid, 0, None)


STAT_PROBE = ATTEMPT + '''
for name, path in (("etc_passwd", "/etc/passwd"), ("service_cmdline", "/proc/SERVICE/cmdline"),
                   ("world_readable", "READABLE"), ("parent", ".."), ("up_and_over", "../etc"),
                   ("relative", "etc")):
    attempt(name, lambda path=path: os.stat(path))
attempt("list_root", lambda: os.listdir("/"))
result = res
'''


@pytest.mark.parametrize("empty_root", [True, False])
def test_a_worker_cannot_even_stat_a_file(tmp_path: Any, empty_root: bool) -> None:
    # Landlock does not cover stat(): a compromised worker could see which
    # files exist and watch the database's size and times change with other
    # guilds' traffic. Each worker now chroots into an empty directory that
    # the fork server made (0700, root) and removed (Landlock off here, so
    # only the empty root refuses).
    from sandbox.check import inspect
    readable = tmp_path / "world-readable.txt"
    readable.write_text("operator data")
    tmp_path.chmod(0o755)
    code = STAT_PROBE.replace("SERVICE", str(os.getpid())).replace("READABLE", str(readable))

    async def scenario(pool: Pool) -> dict[str, Any]:
        ok, res, _ = await exec_seen(pool, code)
        assert ok, res
        return {"probe": res, "layer": pool.hardening["empty_root"],
                "note": pool.hardening_notes.get("empty_root", ""),
                "root": inspect(pool.worker_pids[0])["root"]}

    seen = run_with_pool(scenario, size=1, _unsafe_test_hooks=True, landlock=False,
                         empty_root=empty_root)
    probe = seen["probe"]
    if not empty_root:
        assert seen["layer"] is False and seen["note"] == "disabled by configuration"
        assert probe["etc_passwd"] == "allowed" and probe["list_root"] == "allowed"
        return
    if not ROOT:
        # chroot needs root: the layer says so instead of pretending.
        assert seen["layer"] is False and "not started as root" in seen["note"], seen
        return
    assert seen["layer"] is True
    assert probe == dict.fromkeys(("etc_passwd", "service_cmdline", "world_readable", "parent",
                                   "up_and_over", "relative", "list_root"), errno.EACCES), probe
    # Its root is the removed directory: nothing is left on disk.
    assert seen["root"].endswith(" (deleted)") and "logic-worker-root-" in seen["root"]
    assert not os.path.exists(seen["root"][:-len(" (deleted)")])


#: `attempt` for a C call that reports failure as -1 and errno.
C_ATTEMPT = ATTEMPT + '''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def c_call(fn, *args):
    def call():
        ctypes.set_errno(0)
        if fn(*args) == -1 and ctypes.get_errno():
            raise OSError(ctypes.get_errno(), "")
    return call
'''

OTHERS_PROBE = C_ATTEMPT + '''
import time
class SysInfo(ctypes.Structure):
    _fields_ = [("uptime", ctypes.c_long), ("loads", ctypes.c_ulong * 3),
                ("totalram", ctypes.c_ulong), ("freeram", ctypes.c_ulong),
                ("rest", ctypes.c_char * 128)]
for who, pid in (("sibling", SIBLING), ("service", SERVICE)):
    attempt(who + "_cpu_clock", lambda pid=pid: time.clock_gettime((~pid << 3) | 2))
    attempt(who + "_thread_clock", lambda pid=pid: time.clock_gettime((~pid << 3) | 6))
    attempt(who + "_getpriority", c_call(libc.getpriority, 0, pid))
    attempt(who + "_getpgid", lambda pid=pid: os.getpgid(pid))
    attempt(who + "_getsid", lambda pid=pid: os.getsid(pid))
    attempt(who + "_sched_getscheduler", lambda pid=pid: os.sched_getscheduler(pid))
    attempt(who + "_sched_getparam", lambda pid=pid: os.sched_getparam(pid))
    attempt(who + "_sched_getaffinity", lambda pid=pid: os.sched_getaffinity(pid))
    attempt(who + "_sched_rr_get_interval", lambda pid=pid: os.sched_rr_get_interval(pid))
attempt("sysinfo", c_call(libc.sysinfo, ctypes.byref(SysInfo())))
# What is the worker's own stays open: its CPU time, its own scheduling.
attempt("own_process_time", time.process_time)
attempt("own_thread_time", time.thread_time)
attempt("own_affinity", lambda: os.sched_getaffinity(0))
attempt("own_priority", c_call(libc.getpriority, 0, 0))
result = res
'''


@pytest.mark.parametrize("seccomp", [True, False])
def test_a_worker_cannot_watch_another_process(seccomp: bool) -> None:
    # Outside review, session 17: a hardened worker read a sibling's CPU clock
    # (0.003 s, then 0.578 s while another guild's 0.6 s job ran there) and
    # the service's, learned which pids exist from getpriority(), and the
    # host's free memory from sysinfo(). Seccomp now refuses every call that
    # names another process, and sysinfo.
    async def scenario(pool: Pool) -> dict[str, Any]:
        pids = pool.worker_pids
        code = OTHERS_PROBE.replace("SIBLING", str(pids[1])).replace("SERVICE", str(os.getpid()))
        ok, res, _ = await exec_seen(pool, code)   # runs in pids[0]
        assert ok, res
        return res  # type: ignore[no-any-return]

    res = run_with_pool(scenario, size=2, _unsafe_test_hooks=True, seccomp=seccomp)
    own = ("own_process_time", "own_thread_time", "own_affinity", "own_priority")
    assert all(res[name] == "allowed" for name in own), res
    others = {name: value for name, value in res.items() if name not in own}
    if not seccomp:
        # Without the filter the same calls reach the kernel, which allows them.
        assert others["sibling_cpu_clock"] == "allowed" and others["sysinfo"] == "allowed"
        assert others["service_getpriority"] == "allowed", others
        return
    assert others == dict.fromkeys(others, errno.EPERM), others


HOST_PROBE = C_ATTEMPT + '''
def sync():
    ctypes.set_errno(0)
    libc.sync()   # returns nothing: only errno tells
    if ctypes.get_errno():
        raise OSError(ctypes.get_errno(), "")
attempt("sync", sync)
attempt("syncfs", c_call(libc.syncfs, 2))
attempt("flock", c_call(libc.flock, 2, 2 | 4))                  # LOCK_EX | LOCK_NB on stderr
lock = (ctypes.c_short * 16)()                                     # struct flock, F_WRLCK (1)
lock[0] = 1
attempt("fcntl_setlk", c_call(libc.fcntl, 2, 6, ctypes.byref(lock)))
read_end, write_end = os.pipe()
attempt("pipe_size", c_call(libc.fcntl, write_end, 1031, 1 << 20))
attempt("set_name", c_call(libc.prctl, 15, b"sshd", 0, 0, 0))
result = res
'''


@pytest.mark.parametrize("seccomp", [True, False])
def test_a_worker_cannot_touch_host_wide_or_shared_kernel_state(seccomp: bool) -> None:
    # Red-team pass, session 34, each from a taken-over worker: sync() wrote
    # back every file system of the host (in a loop, for a whole job); flock()
    # or a record lock on the /dev/null every worker shares is a bit another
    # guild's worker reads; a pipe grown to 1 MiB is kernel memory outside
    # every memory bound; prctl(PR_SET_NAME) showed it as "sshd" in ps.
    async def scenario(pool: Pool) -> dict[str, Any]:
        ok, res, _ = await exec_seen(pool, HOST_PROBE)
        assert ok, res
        return res  # type: ignore[no-any-return]

    res = run_with_pool(scenario, size=1, _unsafe_test_hooks=True, seccomp=seccomp)
    if not seccomp:
        assert res["sync"] == "allowed" and res["pipe_size"] == "allowed", res
        assert res["set_name"] == "allowed", res
        return
    assert res == dict.fromkeys(res, errno.EPERM) and len(res) == 6, res


I386_GETPID = '''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
page = libc.mmap(None, 4096, 7, 0x22, -1, 0)   # read, write, execute; private, anonymous
code = bytes([0xb8, 0x14, 0, 0, 0, 0xcd, 0x80, 0xc3])   # mov eax, 20 (i386 getpid); int 0x80; ret
ctypes.memmove(page, code, len(code))
result = {"i386_getpid": ctypes.CFUNCTYPE(ctypes.c_long)(page)(), "pid": os.getpid()}
'''


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the 32-bit x86 ABI is x86_64's")
@pytest.mark.parametrize("seccomp", [True, False])
def test_a_system_call_of_the_32_bit_abi_kills_the_worker(seccomp: bool) -> None:
    # Every rule of the filter is written for x86_64's numbers; through
    # `int 0x80` the same calls have other numbers, so any call of that ABI
    # ends the worker (libseccomp's bad-architecture action) instead of
    # slipping past the rules.
    async def scenario(pool: Pool) -> Any:
        return await pool._test_exec(I386_GETPID)

    out = run_with_pool(scenario, size=1, _unsafe_test_hooks=True, seccomp=seccomp)
    if seccomp:
        assert getattr(out, "error_kind", None) == "crash", out
    else:   # without the filter the call simply works
        ok, value = out
        assert ok and value["i386_getpid"] == value["pid"], out
