"""OS hardening a worker applies to itself after fork, before any script runs.

Order matters and is fixed (see :func:`harden`):

1. close every inherited descriptor but the channel (a child could otherwise
   use the service's listening socket, database connections or log files);
2. rlimits: address space, CPU, open files, file size 0, no core dumps;
3. a new, empty network namespace and a new IPC namespace (need
   CAP_SYS_ADMIN, so before the drop);
4. drop to an unprivileged user, then RLIMIT_NPROC=0 (a process limit only
   binds a non-root user);
5. ``PR_SET_NO_NEW_PRIVS`` (also required for an unprivileged seccomp load);
6. last, the seccomp filter, so every earlier step could still use the
   system calls it needs (the fork server prebuilt its BPF program once, the
   worker patches its own pid into a copy: ``sandbox.seccomp_bpf``).

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
import errno
import os
import signal
from dataclasses import dataclass, field
from typing import Any

from sandbox import landlock, limits, seccomp_bpf

CHANNEL_FD = 3
#: Exit status of a worker in the shared namespaces whose seccomp filter did not
#: load: it never serves (see :func:`harden`).
EXIT_NO_SECCOMP = 67
_CLONE_NEWNET = 0x40000000
_CLONE_NEWIPC = 0x08000000
_CLONE_THREAD = 0x00010000
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_GET_NO_NEW_PRIVS = 39
_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4

_libc = ctypes.CDLL(None, use_errno=True)

try:
    import pyseccomp as _seccomp  # type: ignore[import-untyped]
except Exception:  # pragma: no cover - missing libseccomp on the host
    _seccomp = None

LAYERS = ("close_fds", "rlimits", "network_namespace", "drop_user", "nproc",
          "no_new_privs", "seccomp")


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


def close_inherited_fds(channel_fd: int) -> int:
    """Keep only the channel (moved to fd 3) and /dev/null on 0-2; returns the channel fd."""
    if channel_fd != CHANNEL_FD:
        os.dup2(channel_fd, CHANNEL_FD, inheritable=False)
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
    return CHANNEL_FD


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


def set_parent_death_signal(expected_parent: int) -> None:
    """Die with the parent (the zygote with the service); a credential change clears it."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != expected_parent:  # parent died before the prctl
        os._exit(70)


# --- seccomp ---------------------------------------------------------------

_EPERM_ALWAYS = (
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4",
    "execve", "execveat", "fork", "vfork",
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "mkdir", "mkdirat", "unlink", "unlinkat", "rmdir", "rename", "renameat", "renameat2",
    "link", "linkat", "symlink", "symlinkat", "chmod", "fchmod", "fchmodat",
    "chown", "fchown", "fchownat", "lchown", "truncate", "mknod", "mknodat",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot",
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "init_module", "finit_module", "delete_module", "kexec_load", "reboot",
    "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setgroups",
    "personality",
    # Found in the redteam review (R5-R8): each of these worked for a hardened
    # worker. creat() is open(O_CREAT|O_WRONLY|O_TRUNC) under its own number,
    # so the open/openat flag rules never saw it (it created and truncated
    # files); the *_handle_at pair opens by file handle with any flags.
    "creat", "name_to_handle_at", "open_by_handle_at", "memfd_create",
    "utime", "utimes", "futimesat", "utimensat",
    "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    # Scheduling of *other* processes: as the same user a worker could renice
    # (PRIO_USER: every worker at once), pin or SCHED_IDLE a sibling that runs
    # another guild's script, or move its pages. The runtime needs none.
    "setpriority", "sched_setaffinity", "sched_setscheduler", "sched_setparam",
    "sched_setattr", "ioprio_set", "migrate_pages", "move_pages",
    "process_madvise", "process_mrelease",
    # The new mount API and other administration calls (they need privileges
    # a worker should not have; denied outright in case it has them).
    "fsopen", "fsconfig", "fsmount", "fspick", "open_tree", "move_mount", "mount_setattr",
    "fanotify_init", "acct", "swapon", "swapoff", "sethostname", "setdomainname",
    "syslog", "vhangup", "quotactl", "settimeofday", "clock_settime", "clock_adjtime",
    "adjtimex", "iopl", "ioperm", "kexec_file_load", "uselib", "lookup_dcookie",
    # System V IPC and POSIX message queues (security review V5): segments and
    # queues outlive the worker (memory outside its RLIMIT_AS and memory cap)
    # and would be a channel between workers of different guilds in the IPC
    # namespace the fork server shares. The runtime needs none of them.
    "shmget", "shmat", "shmdt", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl",
    "semget", "semop", "semtimedop", "semctl", "ipc",
    "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
)
# statmount and listmount (Linux 6.8; one number on every architecture since
# 5.1's unified table): the host's mount table, which Landlock leaves open
# (it closes /proc/self/mountinfo). By number: libseccomp before 2.6 does not
# know their names.
_EPERM_BY_NUMBER = (457, 458)
# Namespace flags: refused for clone() even together with CLONE_THREAD (a
# worker that kept capabilities could otherwise enter new namespaces).
# CLONE_NEWTIME (0x80) is only valid for unshare/clone3, both refused.
_CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000,
                          0x20000000, 0x40000000)
# Terminal ioctls that inject input into (or drive) a terminal: with a
# controlling terminal, TIOCSTI types commands into the operator's shell.
# The kernel reads the request as a 32-bit int: compare the low 32 bits only,
# or 0x1_0000_5412 would pass an equality rule and still mean TIOCSTI.
# FIOSETOWN, SIOCSPGRP and FIOASYNC are the ioctl forms of fcntl's F_SETOWN
# and O_ASYNC (below).
_DENIED_IOCTLS = (0x5412, 0x541C,  # TIOCSTI, TIOCLINUX
                  0x8901, 0x8902, 0x5452)  # FIOSETOWN, SIOCSPGRP, FIOASYNC
# fcntl commands that direct a signal at a process the caller names: F_SETOWN,
# F_SETSIG, F_SETOWN_EX, F_SETLEASE (a lease's break signal), F_NOTIFY.
_DENIED_FCNTLS = (8, 10, 15, 1024, 1026)
_IOCTL_CMD_MASK = 0xFFFFFFFF
# Signals (kill, tkill, tgkill, rt_*sigqueueinfo) are allowed only towards the
# worker itself; see load_seccomp and seccomp_bpf.
# Answered "not implemented" so callers take their fallback path: glibc falls
# back from clone3 to clone (which the filter can inspect), Python from
# openat2 to openat.
_ENOSYS = ("clone3", "openat2")
_WRITE_FLAGS = (os.O_WRONLY, os.O_RDWR, os.O_CREAT, os.O_TRUNC)


def build_seccomp_filter() -> Any:
    """Build (not load) the worker filter; done once in the fork server.

    Default allow; EPERM for the calls above, for ``clone`` without
    CLONE_THREAD (a new process) and for ``open``/``openat`` with any of
    O_WRONLY, O_RDWR, O_CREAT, O_TRUNC.  Signal calls get their per-pid
    rules in :func:`load_seccomp` (the fork server prebuilds the program with
    a placeholder pid once, ``seccomp_bpf.prepare``).
    Syscalls of a foreign architecture (32-bit x86 on x86_64) are killed by
    libseccomp's default bad-arch action.
    """
    if _seccomp is None:
        return None
    sc = _seccomp
    flt = sc.SyscallFilter(sc.ALLOW)
    try:
        # A binary tree by syscall number instead of one long list of
        # compares: the same decisions, fewer instructions per system call
        # (and a cheaper install for each worker).
        flt.set_attr(sc.Attr.CTL_OPTIMIZE, 2)
    except (AttributeError, OSError, ValueError):
        pass   # an older libseccomp: the list
    eperm = sc.ERRNO(errno.EPERM)
    for name in _EPERM_ALWAYS:
        try:
            flt.add_rule(eperm, name)
        except (OSError, ValueError):
            pass  # not a syscall on this architecture (e.g. open on arm64)
    for number in _EPERM_BY_NUMBER:
        flt.add_rule(eperm, number)
    for name in _ENOSYS:
        flt.add_rule(sc.ERRNO(errno.ENOSYS), name)
    flt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
    for flag in _CLONE_NAMESPACE_FLAGS:
        flt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    for request in _DENIED_IOCTLS:
        flt.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, _IOCTL_CMD_MASK, request))
    # Signals the kernel sends on the worker's behalf (security review,
    # session 16): F_SETOWN/F_SETSIG and O_ASYNC on a pipe made the kernel
    # send SIGKILL to a same-uid sibling on the next write, past the signal
    # calls' own rules. Owning a descriptor's I/O signals is what starts it;
    # the runtime never does.
    for command in _DENIED_FCNTLS:
        flt.add_rule(eperm, "fcntl", sc.Arg(1, sc.MASKED_EQ, _IOCTL_CMD_MASK, command))
    # Resource limits of another process (a same-uid sibling: lowering its
    # RLIMIT_CPU or RLIMIT_AS kills the guild it serves); pid 0 is "myself",
    # which is what setrlimit() uses and what the CPU backstop needs.
    flt.add_rule(eperm, "prlimit64", sc.Arg(0, sc.NE, 0))
    for flag in _WRITE_FLAGS:
        for name, argno in (("open", 1), ("openat", 2)):
            try:
                flt.add_rule(eperm, name, sc.Arg(argno, sc.MASKED_EQ, flag, flag))
            except (OSError, ValueError):
                pass
    return flt


def load_seccomp(flt: Any) -> tuple[bool, str]:
    """Install this process's filter (irreversible) from what the fork server
    prepared (``seccomp_bpf.prepare``: the prebuilt program, patched with this
    pid) or from a plain filter of :func:`build_seccomp_filter`, to which
    libseccomp adds this process's rules (``seccomp_bpf.add_process_rules``).

    Signals may only be sent to this process itself (its pid is known only
    after fork, hence here): a compromised worker cannot kill a sibling that
    runs another guild's script, even though both run as the same user.
    """
    if flt is None:
        return False, "pyseccomp/libseccomp not available"
    return seccomp_bpf.load(flt)


def harden(channel_fd: int, cfg: HardeningConfig, seccomp_filter: Any,
           shared_netns: tuple[bool, str] | None = None) -> tuple[int, HardeningReport]:
    """Apply every layer in order; returns the channel's new fd and the report.

    ``shared_netns``: the fork server already entered an empty network and
    IPC namespace (``enter_network_namespace`` once, before it forked this
    worker; see :func:`share_network_namespace`): its result is the layer's,
    and the worker does not unshare again.  Such a worker shares those
    namespaces with every other guild's workers, which only the seccomp filter
    makes safe: when the filter does not load it exits (``EXIT_NO_SECCOMP``)
    before it reports ready, so it never serves.
    """
    report = HardeningReport()
    fd = close_inherited_fds(channel_fd)
    report.set("close_fds", True)
    limits.statm_pages()   # opens this worker's /proc/self/statm while it still may
    # The service's environment may hold a database URL with a password or
    # other operator secrets; a worker needs none of it, neither in os.environ
    # nor in the block the kernel copied onto the stack at exec time.
    os.environ.clear()
    wipe_initial_environment()
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
