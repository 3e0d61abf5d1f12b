"""OS hardening a worker applies to itself after fork, before any script runs.

Order matters and is fixed (see :func:`harden`):

1. close every inherited descriptor but the channel (a child could otherwise
   use the service's listening socket, database connections or log files);
2. rlimits: address space, CPU, open files, file size 0, no core dumps;
3. a new, empty network namespace and a new IPC namespace (need
   CAP_SYS_ADMIN, so before the drop);
4. an empty root: ``chroot`` into a directory the fork server made and
   removed (root only, so before the drop): no path names any file;
5. drop to an unprivileged user, then RLIMIT_NPROC=0 (a process limit only
   binds a non-root user);
6. ``PR_SET_NO_NEW_PRIVS`` (also required for an unprivileged seccomp load
   and for Landlock);
7. Landlock: no file is opened from here on (``sandbox.landlock``);
8. last, the seccomp filter (its rules: ``sandbox.seccomp_rules``), so every
   earlier step could still use the system calls it needs (the fork server
   prebuilt its BPF program once, the worker patches its own pid into a
   copy: ``sandbox.seccomp_bpf``).

Each step reports whether it took effect; the pool logs and exposes that as
``pool.hardening``; nothing is skipped silently.  One failure is fatal: a
worker forked into the namespace the fork server shares between all workers
exits (``EXIT_NO_SECCOMP``) when its seccomp filter does not load, because
only the filter keeps workers of different guilds from meeting there.
Every function here changes the calling process and must only run in a
worker.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import tempfile
from dataclasses import dataclass, field
from typing import Any

from sandbox import landlock, limits, seccomp_bpf
from sandbox.seccomp_rules import load_seccomp

CHANNEL_FD = 3
#: Exit status of a worker in the shared namespaces whose seccomp filter did not
#: load: it never serves (see :func:`harden`).
EXIT_NO_SECCOMP = 67
_CLONE_NEWNET = 0x40000000
_CLONE_NEWIPC = 0x08000000
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_GET_NO_NEW_PRIVS = 39
_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4

_libc = ctypes.CDLL(None, use_errno=True)



@dataclass(frozen=True)
class HardeningConfig:
    """What the worker should apply; built in the service, used after fork."""

    address_space: int
    cpu_lifetime_s: int = 3600
    nofile: int = 16
    network_namespace: bool = True
    drop_user: bool = True
    uid: int = 65534
    gid: int = 65534
    seccomp: bool = True
    landlock: bool = True
    empty_root: bool = True


@dataclass
class HardeningReport:
    """Which layers took effect, plus one human note per layer that did not, and
    ``seccomp_load``: how the seccomp filter was installed."""

    layers: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def set(self, layer: str, ok: bool, note: str = "") -> None:
        self.layers[layer] = ok
        if not ok and note:
            self.notes.append(f"{layer}: {note}")


def close_inherited_fds(channel_fd: int, keep: int = -1) -> tuple[int, int]:
    """Keep only the channel (moved to fd 3), /dev/null on 0-2 and ``keep`` (moved
    past 3; -1: none); returns the channel's and ``keep``'s new numbers."""
    if keep >= 0:
        keep = fcntl.fcntl(keep, fcntl.F_DUPFD_CLOEXEC, CHANNEL_FD + 1)
    if channel_fd != CHANNEL_FD:
        os.dup2(channel_fd, CHANNEL_FD, inheritable=False)
    if keep >= 0:
        os.closerange(CHANNEL_FD + 1, keep)
        os.closerange(keep + 1, 1 << 20)
    else:
        os.closerange(CHANNEL_FD + 1, 1 << 20)
    for fd in (0, 1, 2):
        try:
            os.close(fd)
        except OSError:
            pass
    # Stray writes of the runtime to stdout/stderr go nowhere, not into the
    # service's log or terminal.
    null = os.open(os.devnull, os.O_RDWR)  # lowest free number: 0
    for fd in (0, 1, 2):
        if fd != null:
            os.dup2(null, fd)
    return CHANNEL_FD, keep


#: Why ``make_empty_root`` made no directory (set in the fork server, so the
#: workers it forks can say it).
_empty_root_failure = ""


def make_empty_root(cfg: HardeningConfig) -> int:
    """In the fork server: a descriptor of an empty directory that no longer exists
    (made 0700 for root, opened, removed), for every worker's ``chroot``; -1 when
    the layer is off, the service is not root (``chroot`` needs root) or no such
    directory could be made (the reason is kept for the workers' report)."""
    global _empty_root_failure
    if not cfg.empty_root or os.geteuid() != 0:
        return -1
    fd = -1
    try:
        path = tempfile.mkdtemp(prefix="logic-worker-root-")
        try:
            # Not a symbolic link put in its place; owned by root, 0700, and
            # once removed, linked nowhere: the directory mkdtemp made.
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        finally:
            os.rmdir(path)   # nothing is left on disk, whatever ends the service
        st = os.fstat(fd)
        if st.st_uid != 0 or st.st_mode & 0o7777 != 0o700 or st.st_nlink != 0:
            raise OSError(f"{path} was not the empty directory made for it")
        _empty_root_failure = ""
        return fd
    except OSError as exc:
        if fd >= 0:
            os.close(fd)
        _empty_root_failure = exc.strerror or str(exc)
        return -1


def enter_empty_root(root_fd: int) -> tuple[bool, str]:
    """``chroot`` into ``make_empty_root``'s directory and close it: every path,
    ``/`` and ``..`` included, resolves inside a removed directory that only
    root may search, so not even ``stat`` reaches a file (Landlock does not
    cover ``stat``). Needs root: before ``drop_user``."""
    if root_fd < 0:
        why = ("not started as root: chroot needs it; a worker can stat() what its "
               "uid can reach" if os.geteuid() != 0
               else f"no empty directory could be made ({_empty_root_failure or 'unknown'})")
        return False, why
    try:
        os.fchdir(root_fd)
        os.chroot(".")
        os.chdir("/")
    except OSError as exc:
        return False, exc.strerror or str(exc)
    finally:
        os.close(root_fd)
    return True, ""


def enter_network_namespace() -> tuple[bool, str]:
    """unshare(CLONE_NEWNET | CLONE_NEWIPC): the worker sees only a down loopback
    interface, and no System V IPC object or POSIX message queue of the host
    (what is created in the namespace goes with it when its last process exits)."""
    if _libc.unshare(_CLONE_NEWNET | _CLONE_NEWIPC) == 0:
        return True, ""
    return False, os.strerror(ctypes.get_errno())


def share_network_namespace(cfg: HardeningConfig,
                            seccomp_filter: Any) -> tuple[bool, str] | None:
    """In the fork server: enter the workers' empty network and IPC namespaces once.

    Every worker forked afterwards starts in them, so a spare does not pay for
    its own ``unshare`` (~0.6 ms).  Workers then share one network and one IPC
    namespace, which hold nothing (a down ``lo``, no abstract Unix sockets, no
    IPC objects of the host) and in which a worker can create neither a socket
    nor an IPC object (seccomp refuses ``socket``, ``socketpair``, ``shmget``,
    ``msgget``, ``semget``, ``mq_open``, ...).  Without the seccomp filter that
    last part does not hold (two workers could meet through an abstract Unix
    socket or a shared memory segment), so then each worker keeps its own
    namespaces: returns None and the worker unshares itself.  A worker forked
    into the shared namespaces whose filter fails to load exits
    (:func:`harden`).
    """
    if not cfg.network_namespace or not cfg.seccomp or seccomp_filter is None:
        return None
    return enter_network_namespace()


def drop_privileges(uid: int, gid: int) -> tuple[bool, str]:
    """setgroups([]), setgid, setuid when root; False (with a reason) otherwise."""
    if os.geteuid() != 0:
        return False, f"not started as root (uid {os.geteuid()}); workers share the service user"
    try:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    except OSError as exc:
        return False, exc.strerror or str(exc)
    if os.getuid() != uid or os.geteuid() != uid:
        return False, "uid did not change"
    return True, ""


def set_no_new_privs() -> tuple[bool, str]:
    """PR_SET_NO_NEW_PRIVS: no set-uid binary or file capability can add privileges."""
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return False, os.strerror(ctypes.get_errno())
    return _libc.prctl(_PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) == 1, ""


def leave_terminal_session() -> None:
    """setsid(): no controlling terminal, so /dev/tty cannot be opened (R8).

    With the service started from a shell, a worker would otherwise share
    the operator's terminal; TIOCSTI is refused by seccomp as well.
    """
    try:
        os.setsid()
    except OSError:
        pass  # already a session leader: nothing inherited to leave


def make_undumpable() -> tuple[bool, str]:
    """PR_SET_DUMPABLE 0: siblings of the same uid cannot open /proc/<pid>/mem.

    A uid change makes a process undumpable already; without one (service
    not root) every worker and the service share a uid, and a compromised
    worker could read another worker's memory through /proc/<pid>/mem or
    environ (no ptrace needed). Setting it explicitly covers both cases.
    """
    if _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        return False, os.strerror(ctypes.get_errno())
    return _libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 0, ""


_environment = {"cleared": False}


def clear_environment() -> None:
    """Empty ``os.environ`` and zero the initial environment block (R6).

    The service's environment may hold a database URL with a password or
    other operator secrets; a worker needs none of it, neither in
    ``os.environ`` nor in the block the kernel copied onto the stack at exec
    time. The fork server calls this once before it forks: every worker is
    a copy of its memory, so each starts with both empty and does not pay
    again for the file read it takes (a worker forked by anything else still
    clears its own, in ``harden``).
    """
    os.environ.clear()
    wipe_initial_environment()
    _environment["cleared"] = True


def wipe_initial_environment() -> bool:
    """Zero the process's initial environment block (R6).

    ``os.environ.clear()`` only unlinks the variables from libc's
    ``environ``; the strings the kernel placed on the stack at exec time
    (the service's whole environment, e.g. ``LOGIC_DATABASE_URL``, copied
    into every forked process) stay in memory and are what
    ``/proc/<pid>/environ`` shows. Call after ``os.environ.clear()``.
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        # Fields 50 and 51 of proc(5) (env_start, env_end); index 0 is field 3.
        start, end = int(fields[47]), int(fields[48])
    except (OSError, IndexError, ValueError):
        return False
    if not 0 < start < end or end - start > 1 << 24:
        return False
    ctypes.memset(start, 0, end - start)
    return True


def set_parent_death_signal(expected_parent: int, signum: int = signal.SIGKILL) -> None:
    """Get ``signum`` when the parent dies (the zygote: the service; the compile
    process: its server); a credential change clears it."""
    _libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
    if os.getppid() != expected_parent:  # parent died before the prctl
        os._exit(70)


def harden(channel_fd: int, cfg: HardeningConfig, seccomp_filter: Any,
           shared_netns: tuple[bool, str] | None = None,
           root_fd: int = -1) -> tuple[int, HardeningReport]:
    """Apply every layer in order; returns the channel's new fd and the report.

    ``shared_netns``: the fork server already entered an empty network and
    IPC namespace (``enter_network_namespace`` once, before it forked this
    worker; see :func:`share_network_namespace`): its result is the layer's,
    and the worker does not unshare again.  Such a worker shares those
    namespaces with every other guild's workers, which only the seccomp filter
    makes safe: when the filter does not load it exits (``EXIT_NO_SECCOMP``)
    before it reports ready, so it never serves.  ``root_fd``: the fork
    server's ``make_empty_root``.
    """
    report = HardeningReport()
    fd, root_fd = close_inherited_fds(channel_fd, root_fd)
    report.set("close_fds", True)
    limits.statm_pages()   # opens this worker's /proc/self/statm while it still may
    if not _environment["cleared"]:   # else the fork server did it once, before any fork
        clear_environment()
    leave_terminal_session()

    failed = limits.apply_rlimits(address_space=cfg.address_space,
                                  cpu_lifetime_s=cfg.cpu_lifetime_s, nofile=cfg.nofile)
    report.set("rlimits", not failed, "could not set " + ", ".join(failed))

    if cfg.network_namespace and shared_netns is not None:
        report.set("network_namespace", *shared_netns)
    elif cfg.network_namespace:
        ok, why = enter_network_namespace()
        report.set("network_namespace", ok, why)
    else:
        report.set("network_namespace", False, "disabled by configuration")

    if cfg.empty_root:   # after the last file this worker opens by name, before the drop
        report.set("empty_root", *enter_empty_root(root_fd))
    else:
        if root_fd >= 0:
            os.close(root_fd)
        report.set("empty_root", False, "disabled by configuration")

    if cfg.drop_user:
        ok, why = drop_privileges(cfg.uid, cfg.gid)
        report.set("drop_user", ok, why)
    else:
        report.set("drop_user", False, "disabled by configuration")
    # No parent-death signal here: a worker must outlive a crashed zygote and
    # keep serving.  It ends when its channel closes (the service is gone),
    # or, stuck in a loop, at its RLIMIT_CPU soft limit.
    # RLIMIT_NPROC does not bind root (CAP_SYS_RESOURCE), so it only counts
    # as a layer once the uid drop took effect or the service is not root.
    nproc_ok = limits.forbid_new_processes() and os.geteuid() != 0
    report.set("nproc", nproc_ok, "no effect while the worker runs as root")

    ok, why = set_no_new_privs()
    report.set("no_new_privs", ok, why)
    # Not a reported layer (a uid change implies it); a failure is harmless
    # to report as part of no_new_privs' neighbourhood, so it is only applied.
    make_undumpable()

    if cfg.landlock:   # after no_new_privs, which it needs
        report.set("landlock", *landlock.apply())
    else:
        report.set("landlock", False, "disabled by configuration")

    if cfg.seccomp:
        ok, why = load_seccomp(seccomp_filter)
        report.set("seccomp", ok, why)
        if ok:  # not a layer: which path installed it (the prebuilt program or libseccomp)
            report.notes.append("seccomp_load: " + seccomp_bpf.describe(seccomp_filter))
        if not ok and cfg.network_namespace and shared_netns is not None and shared_netns[0]:
            os._exit(EXIT_NO_SECCOMP)   # never serve in the shared namespaces unfiltered
    else:
        report.set("seccomp", False, "disabled by configuration")
    return fd, report
