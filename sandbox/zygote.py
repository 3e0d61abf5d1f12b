"""The fork server ("zygote"): the only process that forks workers.

Workers must be respawned while the service's event loop and threads run,
and forking a multi-threaded process copies locks held by other threads.  So
``Pool.start()`` forks this single-threaded process once, before any loop or
thread exists; it imports and warms everything a worker needs (after the uid
drop a worker may not be able to read the interpreter's files), freezes the
heap (``gc.freeze()``: forked pages stay shared), builds and verifies the
seccomp program once (``sandbox.seccomp_bpf``: a worker only patches its pid
into a copy), enters the workers' empty network and IPC namespaces once
(every fork starts in them; ``hardening.share_network_namespace``), and then
only forks on request.  It never runs user code.

Control socket (SOCK_SEQPACKET, one msgpack message per packet, so passed
descriptors stay attached to their message):

service -> zygote: ``{"t": "spawn", "slot": int}``;
                   ``{"t": "reap", "pids": [int, ...]}``: workers the service killed
                   (about to exit, or exited), named together once per turn of its loop.
zygote -> service: ``{"t": "spawned", "slot", "pid", "fork_ms"}`` with descriptors
                   [channel, pidfd] (pidfd only where the kernel has it);
                   ``{"t": "exit", "pid", "code", "signal", "walked"}`` when it reaps a
                   worker (walked: found by a walk of all children, not by its pid).

Reaping asks the kernel for the workers named by "reap" messages, each by its
pid: ``waitpid(-1)`` walks every child of the caller, and with thousands of
idle workers (one per active guild) a walk at every exit or spawn took a few
per cent of the core (on recent kernels waiting for one pid finds it directly;
older ones walk the children for that too). A walk of all children still runs
once a second, for a worker that exited without being named (or whose name
did not fit in the control socket's queue).

When the control socket closes (the service stops or dies, possibly with
spawn requests still queued: the answer to one then fails) the zygote kills
its workers, waits for them and exits; it does the same if its loop fails,
and when the service dies it is told (PR_SET_PDEATHSIG, SIGTERM) and does the
same: a worker taken over by a script that ignores its channel's end must not
outlive the service (red-team pass, session 34: one slept on, as `nobody`,
after the service was killed).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from typing import Any, NoReturn

import msgpack  # type: ignore[import-untyped]

from sandbox import hardening, limits, seccomp_bpf, seccomp_rules, worker
from sandbox.errors import SpawnError
from sandbox.warm import warm

MAX_CONTROL = 4096
FULL_REAP_S = 1.0   # at most this long between walks of every child (waitpid(-1))


# The zygote is a *fresh interpreter* by default (redteam finding R9): a plain
# fork() copies the service's whole heap and stack into the zygote and so into
# every worker — its settings object with the database URL, the frames of
# serve() that hold it, its imported modules — where a compromised worker
# could read them. After exec only what the bootstrap below imports exists.
# The exec'd interpreter gets an empty environment, isolated mode (-I: no
# PYTHON* variables, no user site, no script directory on sys.path) and the
# service's sys.path so it imports the same sandbox package.
_BOOTSTRAP = (
    "import json, sys\n"
    "payload = json.loads(sys.argv[2])\n"
    "sys.path[:] = payload['path']\n"
    "from sandbox import zygote\n"
    "zygote.main_after_exec(int(sys.argv[1]), payload)\n"
)


def _config_payload(cfg: worker.WorkerConfig, service_pid: int) -> str:
    """The WorkerConfig and what the exec'd zygote needs, as JSON (plain data)."""
    plain = dataclasses.asdict(cfg)
    # RLIMIT_AS is "address space at start + head-room": measured again in the
    # exec'd zygote, which maps far less than the service it came from.
    headroom = max(cfg.hardening.address_space - limits.current_address_space(), 64 << 20)
    return json.dumps({"cfg": plain, "path": [p for p in sys.path if isinstance(p, str)],
                       "service_pid": service_pid, "as_headroom": headroom})


def main_after_exec(ctl_fd: int, payload: dict[str, Any]) -> NoReturn:
    """Entry point of the exec'd zygote (see _BOOTSTRAP)."""
    try:
        plain = payload["cfg"]
        hcfg = hardening.HardeningConfig(**plain.pop("hardening"))
        cfg = worker.WorkerConfig(hardening=hcfg, **plain)
        _main(ctl_fd, cfg, int(payload["service_pid"]), int(payload["as_headroom"]))
    except BaseException:
        os.write(2, ("sandbox fork server failed:\n" + traceback.format_exc()).encode())
    finally:
        os._exit(1)


def start(cfg: worker.WorkerConfig, fresh_interpreter: bool = True) -> tuple[int, socket.socket]:
    """Start the zygote from the (still single-threaded) service process.

    With ``fresh_interpreter`` (the default) the forked child execs a new
    Python at once, so nothing of the service's memory reaches the zygote or
    its workers; without it the child runs on in the service's copy (kept for
    tests that patch the sandbox in the service and expect the zygote to
    inherit the patch). Returns its pid and the service's end of the control
    socket.
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    service_pid = os.getpid()
    argv: list[str] = []
    fresh_interpreter = fresh_interpreter and bool(sys.executable)  # embedded: no python to exec
    if fresh_interpreter:
        # Built before fork: the child only calls execve (async-signal-safe
        # enough for a possibly threaded parent, and nothing else runs there).
        argv = [sys.executable, "-I", "-c", _BOOTSTRAP, str(theirs.fileno()),
                _config_payload(cfg, service_pid)]
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            if fresh_interpreter:
                ours.detach()
                os.set_inheritable(theirs.fileno(), True)
                os.execve(argv[0], argv, {})
            gc.freeze()  # objects of the service are never collected (and closed) here
            ours.detach()
            _main(theirs.detach(), cfg, service_pid)
        except BaseException:
            # stderr is still the service's: say why before the pool reports
            # that the fork server is gone.
            # fd 2 directly: sys.stderr may wrap a descriptor closed above.
            os.write(2, ("sandbox fork server failed:\n" + traceback.format_exc()).encode())
        finally:
            os._exit(1)
    theirs.close()
    return pid, ours


class _Zygote:
    def __init__(self, ctl_fd: int, cfg: worker.WorkerConfig, service_pid: int) -> None:
        self.ctl = socket.socket(fileno=ctl_fd)
        self.cfg = cfg
        self.service_pid = service_pid
        self.children: set[int] = set()
        # Workers the service named as ending ("reap"), waited for by pid.
        self.ending: set[int] = set()
        self.walked_at = time.monotonic()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        # The seccomp program, built and verified once: each worker only writes
        # its pid into it (seccomp_bpf); libseccomp per worker if it cannot be.
        self.filter = (seccomp_bpf.prepare(seccomp_rules.build_seccomp_filter)
                       if cfg.hardening.seccomp else None)
        # Once, for every worker forked from now on (see hardening.share_network_namespace).
        self.netns = hardening.share_network_namespace(cfg.hardening, self.filter)
        # The empty directory every worker makes its root (-1: not root, or off).
        self.root_fd = hardening.make_empty_root(cfg.hardening)

    def send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        data = msgpack.packb(message, use_bin_type=True)
        if fds:
            socket.send_fds(self.ctl, [data], fds)
        else:
            self.ctl.send(data)

    def spawn(self, slot: int) -> None:
        try:
            parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as exc:
            self.send({"t": "spawn_failed", "slot": slot, "error": SpawnError(str(exc)).to_dict()})
            return
        t0 = time.perf_counter()
        try:
            pid = os.fork()
        except OSError as exc:
            parent_end.close()
            child_end.close()
            self.send({"t": "spawn_failed", "slot": slot, "error": SpawnError(str(exc)).to_dict()})
            return
        if pid == 0:  # pragma: no cover - runs in the worker
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)   # the fork server's alone
                # Detach every socket object so that none of them closes a
                # descriptor number later reused for the channel.
                self.ctl.detach()
                parent_end.detach()
                fd = child_end.detach()
                worker.serve(fd, self.cfg, self.filter, self.netns, t0, self.root_fd)
            finally:
                os._exit(70)
        fork_ms = (time.perf_counter() - t0) * 1000.0
        self.children.add(pid)
        child_end.close()
        fds = [parent_end.fileno()]
        pidfd = -1
        try:
            pidfd = os.pidfd_open(pid)
            fds.append(pidfd)
        except (AttributeError, OSError):
            pass
        try:
            self.send({"t": "spawned", "slot": slot, "pid": pid, "fork_ms": fork_ms}, fds)
        finally:
            parent_end.close()
            if pidfd >= 0:
                os.close(pidfd)

    def reap(self) -> None:
        """Wait for every child that exited: a walk of all children."""
        self.walked_at = time.monotonic()
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.reaped(pid, status, walked=True)

    def reap_ending(self) -> None:
        """Wait for the workers the service named, each by its pid."""
        for pid in list(self.ending):
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:   # not ours (any more): nothing to wait for
                self.ending.discard(pid)
                continue
            if got == pid:
                self.reaped(pid, status, walked=False)

    def reaped(self, pid: int, status: int, walked: bool) -> None:
        self.children.discard(pid)
        self.ending.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        try:
            self.send({"t": "exit", "pid": pid, "code": max(code, 0),
                       "signal": -code if code < 0 else 0, "walked": walked})
        except OSError:
            pass

    def loop(self) -> NoReturn:
        # poll(), not select(): the descriptors inherited from a service with
        # thousands of workers may be numbered past select()'s 1024.
        poller = select.poll()
        poller.register(self.ctl.fileno(), select.POLLIN)
        poller.register(self.wake_r, select.POLLIN)
        while True:
            if _terminated[0]:
                _terminating(self, self.service_pid)
            wait_ms = (self.walked_at + FULL_REAP_S - time.monotonic()) * 1000.0
            try:
                readable = [fd for fd, _ in poller.poll(max(0, int(wait_ms) + 1))]
            except InterruptedError:
                readable = []
            if self.wake_r in readable:      # SIGCHLD
                os.read(self.wake_r, 512)
                self.reap_ending()
            if self.ctl.fileno() in readable:
                try:
                    data = self.ctl.recv(MAX_CONTROL)
                except OSError:
                    data = b""
                if not data:
                    self.shutdown()
                try:
                    msg = msgpack.unpackb(data, raw=False)
                except Exception:
                    continue
                if not isinstance(msg, dict):
                    continue
                if msg.get("t") == "spawn" and type(msg.get("slot")) is int:
                    try:
                        self.spawn(msg["slot"])
                    except OSError:
                        # The service closed its end with this request still
                        # queued (stopping, or an aborted start): it is gone.
                        self.shutdown()
                elif msg.get("t") == "reap" and type(msg.get("pids")) is list:
                    self.ending.update(pid for pid in msg["pids"]
                                       if type(pid) is int and pid in self.children)
                    self.reap_ending()
            # After the messages: a worker named in this round is waited for by pid.
            if time.monotonic() - self.walked_at >= FULL_REAP_S:
                self.reap()

    def shutdown(self) -> NoReturn:
        """Kill and wait for every worker, then exit: the service is gone."""
        self.end_children()
        os._exit(0)

    def end_children(self) -> None:
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in list(self.children):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        self.children.clear()


#: SIGTERM seen (`_on_sigterm`): the loop decides what it means at its next turn.
_terminated = [False]


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM, also the parent-death signal. Only noted here: the handler runs
    between any two bytecodes, inside a reap or a fork; the loop, woken by
    the signal's byte on the wakeup descriptor, acts on it (`_terminating`)."""
    _terminated[0] = True


def _terminating(zygote: "_Zygote", service_pid: int) -> NoReturn:
    """The loop saw SIGTERM. With the service gone (this process was given to
    another parent), every worker is killed and waited for, then it exits: one
    taken over so that it ignores its channel's end would otherwise live on
    (red-team pass, session 34). From anyone else while the service lives (an
    operator's `kill`): it ends as SIGTERM always ended it, its workers
    serving on (they do not die with the fork server)."""
    if os.getppid() != service_pid:
        os.write(2, b"sandbox fork server: the service is gone; ending its workers\n")
        zygote.shutdown()
    os.write(2, b"sandbox fork server: ended by SIGTERM; its workers serve on\n")
    os._exit(128 + signal.SIGTERM)


def _batch_scheduling() -> None:
    """Put the fork server, and so every worker it forks, under SCHED_BATCH.

    A waking SCHED_BATCH task does not preempt the task running on its core
    (it runs when that task blocks or at the scheduler tick, a few ms); its
    share of the CPU is unchanged.  So a job sent to a worker no longer
    suspends the service inside that send: the service goes on with its
    event-loop turn (reading, answering, sending the other jobs that are
    ready) and the worker runs when the service waits.  On a core shared by
    the service and its workers that is fewer context switches per request
    (docs/performance.md).  Only from the default policy: a service run
    under SCHED_IDLE (or BATCH) leaves its workers there, never above itself.
    Not a security layer: a kernel without the policy leaves the default one.
    """
    try:
        if os.sched_getscheduler(0) == os.SCHED_OTHER:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def _main(ctl_fd: int, cfg: worker.WorkerConfig, service_pid: int,
          as_headroom: int | None = None) -> NoReturn:
    # Keep stdio for diagnostics; drop every other descriptor of the service
    # (listening sockets, database connections, log files).
    os.closerange(3, ctl_fd)
    os.closerange(ctl_fd + 1, 1 << 20)
    # Own process group: a terminal's Ctrl-C reaches the service, which then
    # stops the pool, not every worker mid-script.
    os.setpgid(0, 0)
    # Handlers the service installed before start() are Python code of the
    # service: they must never run here or in a worker.
    signal.set_wakeup_fd(-1)
    for signum in signal.valid_signals():
        try:
            if callable(signal.getsignal(signum)):
                signal.signal(signum, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    hardening.set_parent_death_signal(service_pid, signal.SIGTERM)
    _batch_scheduling()
    warm()
    # After the imports (which may read the environment), before any fork.
    hardening.clear_environment()
    if as_headroom is not None:
        # Exec'd: the address space that workers start from is ours, now.
        cfg = dataclasses.replace(cfg, hardening=dataclasses.replace(
            cfg.hardening, address_space=limits.current_address_space() + as_headroom))
    zygote = _Zygote(ctl_fd, cfg, service_pid)
    # A Python-level SIGCHLD handler that does nothing: its only effect is the
    # byte written to the wakeup fd, which ends select() so we reap at once.
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(zygote.wake_w)
    gc.collect()
    gc.freeze()
    try:
        zygote.loop()
    finally:
        # Whatever ended the loop, no worker outlives the fork server (its
        # workers would be reparented, unreaped, to whatever reaps orphans).
        zygote.end_children()
