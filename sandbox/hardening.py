"""OS hardening a worker applies to itself after fork, before any script runs.

Order matters and is fixed (see :func:`harden`):

1. close every inherited descriptor but the channel (a child could otherwise
   use the service's listening socket, database connections or log files);
2. rlimits: address space, CPU, open files, file size 0, no core dumps;
3. a new, empty network namespace (needs CAP_SYS_ADMIN, so before the drop);
4. drop to an unprivileged user, then RLIMIT_NPROC=0 (a process limit only
   binds a non-root user);
5. ``PR_SET_NO_NEW_PRIVS`` (also required for an unprivileged seccomp load);
6. last, the seccomp filter, so every earlier step could still use the
   system calls it needs.

Each step reports whether it took effect; the pool logs and exposes that as
``pool.hardening``; nothing is skipped silently.  Every function here changes
the calling process and must only run in a worker.
"""
from __future__ import annotations

import ctypes
import errno
import os
import signal
from dataclasses import dataclass, field
from typing import Any

from sandbox import limits

CHANNEL_FD = 3
_CLONE_NEWNET = 0x40000000
_CLONE_THREAD = 0x00010000
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_GET_NO_NEW_PRIVS = 39

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


@dataclass
class HardeningReport:
    """Which layers took effect, plus one human note per layer that did not."""

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
    """unshare(CLONE_NEWNET): the worker sees only a down loopback interface."""
    if _libc.unshare(_CLONE_NEWNET) == 0:
        return True, ""
    return False, os.strerror(ctypes.get_errno())


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
)
# Signals (kill, tkill, tgkill, rt_*sigqueueinfo) are allowed only towards the
# worker itself; see load_seccomp.
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
    rules in :func:`load_seccomp`.
    Syscalls of a foreign architecture (32-bit x86 on x86_64) are killed by
    libseccomp's default bad-arch action.
    """
    if _seccomp is None:
        return None
    sc = _seccomp
    flt = sc.SyscallFilter(sc.ALLOW)
    eperm = sc.ERRNO(errno.EPERM)
    for name in _EPERM_ALWAYS:
        try:
            flt.add_rule(eperm, name)
        except (OSError, ValueError):
            pass  # not a syscall on this architecture (e.g. open on arm64)
    for name in _ENOSYS:
        flt.add_rule(sc.ERRNO(errno.ENOSYS), name)
    flt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
    for flag in _WRITE_FLAGS:
        for name, argno in (("open", 1), ("openat", 2)):
            try:
                flt.add_rule(eperm, name, sc.Arg(argno, sc.MASKED_EQ, flag, flag))
            except (OSError, ValueError):
                pass
    return flt


_SIGNAL_CALLS = (("kill", 0), ("tkill", 0), ("tgkill", 0), ("rt_sigqueueinfo", 0),
                 ("rt_tgsigqueueinfo", 0))


def load_seccomp(flt: Any) -> tuple[bool, str]:
    """Add the per-process rules to the prebuilt filter and install it (irreversible).

    Signals may only be sent to this process itself (its pid is known only
    after fork, hence here): a compromised worker cannot kill a sibling that
    runs another guild's script, even though both run as the same user.
    """
    if flt is None:
        return False, "pyseccomp/libseccomp not available"
    sc = _seccomp
    eperm = sc.ERRNO(errno.EPERM)
    try:
        me = os.getpid()
        for name, argno in _SIGNAL_CALLS:
            flt.add_rule(eperm, name, sc.Arg(argno, sc.NE, me))
        for name in ("pidfd_send_signal", "pidfd_open"):
            flt.add_rule(eperm, name)
        flt.load()
    except OSError as exc:
        return False, exc.strerror or str(exc)
    return True, ""


def harden(channel_fd: int, cfg: HardeningConfig,
           seccomp_filter: Any) -> tuple[int, HardeningReport]:
    """Apply every layer in order; returns the channel's new fd and the report."""
    report = HardeningReport()
    fd = close_inherited_fds(channel_fd)
    report.set("close_fds", True)
    # The service's environment may hold a database URL with a password or
    # other operator secrets; a worker needs none of it.
    os.environ.clear()

    failed = limits.apply_rlimits(address_space=cfg.address_space,
                                  cpu_lifetime_s=cfg.cpu_lifetime_s, nofile=cfg.nofile)
    report.set("rlimits", not failed, "could not set " + ", ".join(failed))

    if cfg.network_namespace:
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

    if cfg.seccomp:
        ok, why = load_seccomp(seccomp_filter)
        report.set("seccomp", ok, why)
    else:
        report.set("seccomp", False, "disabled by configuration")
    return fd, report
