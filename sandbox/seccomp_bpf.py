"""The worker's seccomp filter as a BPF program built once and patched per worker.

The filter holds one per-process value: the worker's own pid, the only target
its signal calls may name (``add_process_rules``).  Having libseccomp add
those rules and generate the program in every worker cost ~1.8 ms of CPU per
new worker, so the fork server does it once (:func:`prepare`):

1. it builds the filter with a placeholder pid that no process can have
   (pids are below 2**22 on Linux; the placeholder's high 32 bits are 0, as a
   real pid's, so libseccomp emits the same compare of the argument's high
   half) and exports libseccomp's BPF program;
2. it verifies the program: every instruction whose ``k`` is the placeholder
   is a ``BPF_JMP|BPF_JEQ|BPF_K`` compare, and there are exactly as many as
   the instructions in which libseccomp's own programs for two probe pids
   differ (libseccomp merges identical code: the five signal rules share one
   compare); the template with a probe pid patched in must equal, byte for
   byte, libseccomp's program for that pid;
3. each worker copies the template, writes its pid into those compares and
   installs it with ``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)`` (what
   ``seccomp_load`` does with libseccomp's default attributes: no new
   privileges first, no thread synchronisation, no log flag).

A template that cannot be exported or verified is never loaded: every worker
then has libseccomp build and load its filter as before (:func:`load`), and
says so in its hardening report (``seccomp_load``).
"""
from __future__ import annotations

import ctypes
import errno
import os
import struct
from dataclasses import dataclass
from typing import Any, Callable

try:
    import pyseccomp as _seccomp  # type: ignore[import-untyped]
except Exception:  # pragma: no cover - missing libseccomp on the host
    _seccomp = None

#: Stands for the worker's pid in the template; above every possible pid
#: (PID_LIMIT) and below 2**32 (so its high half is a pid's: 0).
PLACEHOLDER_PID = 0x3FFFFFF0
#: Pids are below this on Linux (PID_MAX_LIMIT on 64-bit).
PID_LIMIT = 1 << 22
#: Two pids the template is checked against (any real pid is > 0; pid 0
#: would meet the ``prlimit64`` rule's compare with 0).
PROBE_PIDS = (1, PID_LIMIT - 1)
BPF_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
BPF_MAXINSNS = 4096
INSN = struct.Struct("=HBBI")  # struct sock_filter: code, jt, jf, k (native order)
_K = struct.Struct("=I")
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_PR_SET_NO_NEW_PRIVS = 38

#: Signal calls whose first argument is the target: allowed only towards itself.
SIGNAL_CALLS = (("kill", 0), ("tkill", 0), ("tgkill", 0), ("rt_sigqueueinfo", 0),
                ("rt_tgsigqueueinfo", 0))


class TemplateError(ValueError):
    """The exported program is not one this module may patch and load."""


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


_prctl = ctypes.CDLL(None, use_errno=True).prctl
_prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
_prctl.restype = ctypes.c_int


def add_process_rules(flt: Any, pid: int) -> None:
    """Signals only to ``pid`` itself; ``pidfd_send_signal``/``pidfd_open`` never."""
    sc = _seccomp
    eperm = sc.ERRNO(errno.EPERM)
    for name, argno in SIGNAL_CALLS:
        flt.add_rule(eperm, name, sc.Arg(argno, sc.NE, pid))
    for name in ("pidfd_send_signal", "pidfd_open"):
        flt.add_rule(eperm, name)


def load_with_libseccomp(flt: Any) -> tuple[bool, str]:
    """The slow path: add this process's rules to ``flt`` and let libseccomp load it."""
    if flt is None or _seccomp is None:
        return False, "pyseccomp/libseccomp not available"
    try:
        add_process_rules(flt, os.getpid())
        flt.load()
    except OSError as exc:
        return False, exc.strerror or str(exc)
    return True, ""


def export_program(flt: Any) -> bytes:
    """libseccomp's BPF program for ``flt`` (``seccomp_export_bpf`` into a memfd)."""
    fd = os.memfd_create("seccomp-bpf", os.MFD_CLOEXEC)
    try:
        with open(fd, "rb", closefd=False) as f:
            flt.export_bpf(f)
        size = os.lseek(fd, 0, os.SEEK_END)
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def placeholder_offsets(program: bytes, placeholder: int, expected: int) -> tuple[int, ...]:
    """Byte offsets of the ``k`` fields that hold ``placeholder``; raises TemplateError
    unless there are exactly ``expected`` of them, all in ``JEQ|K`` jumps."""
    if not program or len(program) % INSN.size or len(program) // INSN.size > BPF_MAXINSNS:
        raise TemplateError(f"not a BPF program of at most {BPF_MAXINSNS} instructions "
                            f"({len(program)} bytes)")
    offsets = []
    for at in range(0, len(program), INSN.size):
        code, _, _, k = INSN.unpack_from(program, at)
        if k != placeholder:
            continue
        if code != BPF_JEQ_K:
            raise TemplateError(f"placeholder in instruction {at // INSN.size} "
                                f"(code {code:#x}), not a JEQ|K compare")
        offsets.append(at + 4)
    if len(offsets) != expected:
        raise TemplateError(f"placeholder in {len(offsets)} instructions, expected {expected}")
    return tuple(offsets)


def patch(program: bytes, offsets: tuple[int, ...], pid: int) -> bytearray:
    """A copy of ``program`` with ``pid`` as the ``k`` at each offset."""
    if not 0 < pid < PID_LIMIT:
        raise ValueError(f"not a pid: {pid}")
    out = bytearray(program)
    for at in offsets:
        _K.pack_into(out, at, pid)
    return out


class Template:
    """A verified program, where its placeholder pid is, and the program's
    ``struct sock_fprog`` made ready for the kernel (in the fork server: a
    worker only writes its pid into its own copy-on-write copy of the buffer)."""

    def __init__(self, program: bytes, offsets: tuple[int, ...]) -> None:
        self.program = program
        self.offsets = offsets
        self._buf = ctypes.create_string_buffer(program, len(program))
        self._fprog = _SockFprog(len(program) // INSN.size, ctypes.addressof(self._buf))
        self._fprog_at = ctypes.addressof(self._fprog)

    def for_pid(self, pid: int) -> bytearray:
        """The program of the process ``pid`` (a copy)."""
        return patch(self.program, self.offsets, pid)

    def install(self, pid: int) -> tuple[bool, str]:
        """Write ``pid`` into every placeholder compare of the buffer and install it.

        Irreversible. Without SECCOMP_FILTER_FLAG_TSYNC (libseccomp's default too)
        the filter binds the calling thread and the threads it creates later: a
        worker is single-threaded here (a fork copies only the forking thread,
        and nothing before this step starts one). In a forked worker the writes
        land in its private copy of the buffer; every compare gets the pid
        again, so whatever an earlier call wrote there does not matter.
        """
        if not 0 < pid < PID_LIMIT:
            return False, f"not a pid: {pid}"
        buf = self._buf
        for at in self.offsets:
            _K.pack_into(buf, at, pid)
        if (_prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                or _prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, self._fprog_at, 0, 0) != 0):
            return False, os.strerror(ctypes.get_errno())
        return True, ""


def _program_for(build_base: Callable[[], Any], pid: int) -> bytes:
    flt = build_base()
    if flt is None:
        raise TemplateError("no filter to export")
    add_process_rules(flt, pid)
    return export_program(flt)


def build_template(build_base: Callable[[], Any]) -> Template:
    """Build, export and verify the template (module doc); raises TemplateError or OSError."""
    template = _program_for(build_base, PLACEHOLDER_PID)
    probes = [(pid, _program_for(build_base, pid)) for pid in PROBE_PIDS]
    (_, first), (_, second) = probes
    if len(first) != len(template) or len(second) != len(template):
        raise TemplateError("the program's length depends on the pid")
    # Where libseccomp compares with the pid: the instructions that differ
    # between its programs for two pids (one per signal rule at most).
    differ = [at for at in range(0, len(first), INSN.size)
              if first[at:at + INSN.size] != second[at:at + INSN.size]]
    if not 1 <= len(differ) <= len(SIGNAL_CALLS):
        raise TemplateError(f"the pid is in {len(differ)} instructions")
    offsets = placeholder_offsets(template, PLACEHOLDER_PID, len(differ))
    if [at - 4 for at in offsets] != differ:
        raise TemplateError("the placeholder is not where libseccomp puts the pid")
    for pid, program in probes:
        if patch(template, offsets, pid) != program:
            raise TemplateError(f"the template for pid {pid} is not libseccomp's program")
    return Template(template, offsets)


@dataclass(frozen=True)
class Prepared:
    """What the fork server prepared for its workers' seccomp step: the verified
    template, or (when there is none) a libseccomp filter each worker completes
    and loads itself, with the reason."""

    template: Template | None
    fallback: Any = None
    why: str = ""

    def describe(self) -> str:
        """How a worker installs its filter (the ``seccomp_load`` note)."""
        if self.template is not None:
            return (f"prebuilt BPF program ({len(self.template.program) // INSN.size} "
                    f"instructions), pid patched into {len(self.template.offsets)} compare(s)")
        return f"libseccomp in each worker; the prebuilt program is not used: {self.why}"


def prepare(build_base: Callable[[], Any]) -> Prepared | None:
    """In the fork server: the template, or the fallback; None without libseccomp."""
    try:
        return Prepared(build_template(build_base))
    except Exception as exc:  # noqa: BLE001 - any doubt: libseccomp in each worker
        fallback = build_base()
        if fallback is None:
            return None
        return Prepared(None, fallback, str(exc) or type(exc).__name__)


def load(prepared: Any) -> tuple[bool, str]:
    """Install this process's filter from what the fork server prepared (or from a
    plain libseccomp filter, which gets this process's rules added)."""
    if isinstance(prepared, Prepared):
        if prepared.template is None:
            return load_with_libseccomp(prepared.fallback)
        return prepared.template.install(os.getpid())
    return load_with_libseccomp(prepared)


def describe(prepared: Any) -> str:
    """How :func:`load` installs the filter for ``prepared``."""
    if isinstance(prepared, Prepared):
        return prepared.describe()
    return "libseccomp in each worker"
