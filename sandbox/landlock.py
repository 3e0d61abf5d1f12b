"""Landlock: a worker opens no file and signals no process outside itself.

The seccomp filter refuses opening files for writing, but not for reading,
and the uid drop only keeps a worker out of what `nobody` may not read. A
compromised worker could still read what every user may: the service's
``/proc/<pid>/cmdline`` (a ``--database-url`` with its password), its
``/proc/<pid>/net/tcp`` (the addresses of every guild's callers), other
workers' ``/proc`` entries - and, when the service does not run as root and
workers keep its uid, the database file itself (security review, session 16).

Everything a worker needs from the file system is opened before it serves:
the fork server imported every module (``sandbox.warm``), and the worker
keeps ``/proc/self/statm`` open (``limits.ProcessMemory``). So the ruleset
here handles every file-system right the kernel knows and grants none: no
open, no directory listing, no execution, no creation, anywhere - its own
``/proc/<pid>/`` included (``net/tcp`` there is the service's TCP table when
the worker shares the service's network namespace, as it does when the
service is not root; the operator's check and the tests read a worker's
``/proc`` entries from outside). Where the
kernel's Landlock ABI has them, the same ruleset refuses TCP bind/connect
(ABI 4) and scopes signals and abstract UNIX sockets to the worker itself
(ABI 6). Descriptors opened before (the channel, /dev/null, statm) keep
working: Landlock checks at open time.

Landlock needs Linux 5.13 with the LSM enabled; elsewhere the layer reports
itself off (``apply`` returns False and why) and the other layers stand.
"""
from __future__ import annotations

import ctypes
import errno
import os
import struct

# Generic syscall numbers (the same on x86_64 and arm64).
_SYS_CREATE_RULESET = 444
_SYS_RESTRICT_SELF = 446
_CREATE_RULESET_VERSION = 1 << 0

#: File-system rights by the ABI version that introduced them.
_FS_RIGHTS_BY_ABI = (
    (1, (1 << 13) - 1),   # EXECUTE .. MAKE_SYM (13 rights)
    (2, 1 << 13),         # REFER
    (3, 1 << 14),         # TRUNCATE
    (5, 1 << 15),         # IOCTL_DEV
)
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1            # ABI 4
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def abi_version() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is unavailable."""
    version = _libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0),
                            ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(int(version), 0)


def ruleset_attr(abi: int) -> bytes:
    """``struct landlock_ruleset_attr`` for ``abi``, as long as that ABI knows it."""
    fs = 0
    for since, rights in _FS_RIGHTS_BY_ABI:
        if abi >= since:
            fs |= rights
    if abi >= 6:
        return struct.pack("=QQQ", fs, _NET_BIND_TCP | _NET_CONNECT_TCP,
                           _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL)
    if abi >= 4:
        return struct.pack("=QQ", fs, _NET_BIND_TCP | _NET_CONNECT_TCP)
    return struct.pack("=Q", fs)


def describe(abi: int) -> str:
    parts = ["no file opened"]
    if abi >= 4:
        parts.append("no TCP")
    if abi >= 6:
        parts.append("signals and abstract sockets scoped to itself")
    return f"ABI {abi}: " + ", ".join(parts)


def _probe() -> tuple[int, str]:
    abi = abi_version()
    err = ctypes.get_errno() if abi < 1 else 0
    return abi, (os.strerror(err) if err else "no ABI")


# Asked once, where this module is imported (the fork server): a worker only
# creates its ruleset and restricts itself.
ABI, _UNAVAILABLE = _probe()
_ATTR = ruleset_attr(ABI) if ABI >= 1 else b""
_ATTR_BUF = ctypes.create_string_buffer(_ATTR, len(_ATTR))


def apply() -> tuple[bool, str]:
    """Restrict this process for good (needs ``no_new_privs`` or CAP_SYS_ADMIN)."""
    if ABI < 1:
        return False, f"Landlock unavailable ({_UNAVAILABLE})"
    fd = _libc.syscall(_SYS_CREATE_RULESET, _ATTR_BUF, ctypes.c_size_t(len(_ATTR)),
                       ctypes.c_uint32(0))
    if fd < 0:
        return False, f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}"
    try:
        if _libc.syscall(_SYS_RESTRICT_SELF, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            err = ctypes.get_errno()
            why = ("no_new_privs is not set" if err == errno.EPERM else os.strerror(err))
            return False, f"landlock_restrict_self: {why}"
    finally:
        os.close(fd)
    return True, describe(ABI)

