"""The worker's seccomp filter: which system calls it refuses, and how.

Built once by the fork server (``build_seccomp_filter``), loaded by every
worker with its own pid patched in (``load_seccomp``, ``sandbox.seccomp_bpf``)
as the last step of ``sandbox.hardening.harden``; the save-time compile
process (``sandbox.compile_gate``) loads the same filter.
"""
from __future__ import annotations

import errno
import os
from typing import Any

from sandbox import seccomp_bpf

try:
    import pyseccomp as _seccomp  # type: ignore[import-untyped]
except Exception:  # pragma: no cover - missing libseccomp on the host
    _seccomp = None

_CLONE_THREAD = 0x00010000

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
    # A file system's free blocks and inodes (outside review, session 17):
    # statfs("/") in the empty root still named the disk that holds the
    # database, whose free space moves with other guilds' traffic; fstatfs
    # on any descriptor and ustat by device number say the same.
    "statfs", "fstatfs", "ustat",
    # The host's free memory and load (outside review, session 17): they move
    # with the memory and CPU other guilds' scripts use. capget names any pid.
    "sysinfo", "capget",
    # Red-team pass, session 34: sync() writes back every file system of the
    # host (loopable within a job); flock() on a descriptor every worker
    # shares (its /dev/null) is a bit another guild's worker can read.
    "sync", "syncfs", "flock",
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
_DENIED_FCNTLS = (8, 10, 15, 1024, 1026,
                  # Record locks (F_SETLK, F_SETLKW, F_OFD_SETLK, F_OFD_SETLKW):
                  # flock's channel by another call; a pipe's buffer grown to
                  # 1 MiB (F_SETPIPE_SZ), kernel memory outside every memory
                  # bound (red-team pass, session 34).
                  6, 7, 37, 38, 1031)
_IOCTL_CMD_MASK = 0xFFFFFFFF
_PR_SET_PDEATHSIG = 1
# The name `ps` and /proc show for the process (a worker called itself "sshd").
_PR_SET_NAME = 15
# Calls that read something of the process (or thread) their argument names,
# with 0 meaning the caller (outside review, session 17: a sibling's CPU clock
# showed when and how long another guild's script ran, getpriority() which
# pids exist). Refused for any pid but 0: (name, argument number).
_SELF_ONLY = (("getpriority", 1), ("ioprio_get", 1), ("sched_getparam", 0),
              ("sched_getscheduler", 0), ("sched_getaffinity", 0),
              ("sched_rr_get_interval", 0), ("sched_getattr", 0), ("getpgid", 0),
              ("getsid", 0), ("get_robust_list", 0))
# The clocks of CPU time take a clock id; a negative one (bit 31 of the 32-bit
# id) encodes another process's or thread's pid. A worker's own CPU time is
# CLOCK_PROCESS_CPUTIME_ID (2) or CLOCK_THREAD_CPUTIME_ID (3), what
# time.process_time() and time.thread_time() use.
_CLOCK_CALLS = ("clock_gettime", "clock_getres", "clock_nanosleep", "timer_create")
_CLOCK_ID_NEGATIVE = 0x80000000
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
    # The parent-death signal (security review, session 27): a save-time
    # compile process dies with the compile server that enforces its
    # wall-clock limit; unsetting it would let a taken-over one outlive it.
    for option in (_PR_SET_PDEATHSIG, _PR_SET_NAME):
        flt.add_rule(eperm, "prctl", sc.Arg(0, sc.MASKED_EQ, _IOCTL_CMD_MASK, option))
    # Resource limits of another process (a same-uid sibling: lowering its
    # RLIMIT_CPU or RLIMIT_AS kills the guild it serves); pid 0 is "myself",
    # which is what setrlimit() uses and what the CPU backstop needs.
    flt.add_rule(eperm, "prlimit64", sc.Arg(0, sc.NE, 0))
    for name, argno in _SELF_ONLY:
        flt.add_rule(eperm, name, sc.Arg(argno, sc.NE, 0))
    for name in _CLOCK_CALLS:
        flt.add_rule(eperm, name, sc.Arg(0, sc.MASKED_EQ, _CLOCK_ID_NEGATIVE,
                                         _CLOCK_ID_NEGATIVE))
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
