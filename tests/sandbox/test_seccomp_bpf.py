"""The worker's seccomp program: built and verified once by the fork server, the
worker's pid patched into a copy per worker (``sandbox.seccomp_bpf``).

The worker tests use the pool's test-only hook (``Pool(_unsafe_test_hooks=True)``,
``pool._test_exec``), as ``test_hardening.py`` does.
"""
from __future__ import annotations

import errno
import os
from typing import Any

import pytest

from sandbox import seccomp_bpf, seccomp_rules
from sandbox.pool import Pool
from sandbox.seccomp_bpf import INSN, PLACEHOLDER_PID, TemplateError

from tests.sandbox.poolkit import exec_seen, run_with_pool

pytestmark = pytest.mark.timeout(60)

RET, LD_ABS, JEQ, JGT = 0x06, 0x20, 0x15, 0x25
ALLOW, EPERM = 0x7FFF0000, 0x00050001
#: Not a pid, and a constant libseccomp emits anyway (the x32 system-call bit).
CLASHING_PLACEHOLDER = 0x40000000


def _program(*insns: tuple[int, int, int, int]) -> bytes:
    return b"".join(INSN.pack(*insn) for insn in insns)


# Two placeholder compares among other instructions, and a near miss
# (placeholder + 1) that must stay as it is.
SAMPLE = _program((LD_ABS, 0, 0, 0x10), (JEQ, 1, 0, PLACEHOLDER_PID), (RET, 0, 0, EPERM),
                  (JEQ, 0, 1, PLACEHOLDER_PID), (RET, 0, 0, ALLOW),
                  (JEQ, 0, 1, PLACEHOLDER_PID + 1), (RET, 0, 0, ALLOW))


def test_patch_replaces_every_placeholder_and_changes_nothing_else() -> None:
    offsets = seccomp_bpf.placeholder_offsets(SAMPLE, PLACEHOLDER_PID, 2)
    assert offsets == (1 * INSN.size + 4, 3 * INSN.size + 4)
    patched = seccomp_bpf.patch(SAMPLE, offsets, 4242)
    before, after = list(INSN.iter_unpack(SAMPLE)), list(INSN.iter_unpack(patched))
    assert len(after) == len(before) == 7
    for old, new in zip(before, after):
        assert new == (old[:3] + (4242,) if old[3] == PLACEHOLDER_PID else old)
    assert seccomp_bpf.placeholder_offsets(bytes(patched), PLACEHOLDER_PID, 0) == ()
    # The highest pid Linux can give; nothing outside (0, 2**22) is a pid.
    highest = seccomp_bpf.PID_LIMIT - 1
    assert INSN.unpack_from(seccomp_bpf.patch(SAMPLE, offsets, highest), 8)[3] == highest
    for not_a_pid in (0, -1, 1 << 22, PLACEHOLDER_PID):
        with pytest.raises(ValueError):
            seccomp_bpf.patch(SAMPLE, offsets, not_a_pid)


def test_a_program_with_unexpected_placeholders_is_refused() -> None:
    for expected in (0, 1, 3):
        with pytest.raises(TemplateError, match="placeholder in 2 instructions"):
            seccomp_bpf.placeholder_offsets(SAMPLE, PLACEHOLDER_PID, expected)
    # The placeholder anywhere but in a JEQ|K compare: a return value, another
    # jump, a load.
    for code in (RET, JGT, LD_ABS):
        with pytest.raises(TemplateError, match="not a JEQ"):
            seccomp_bpf.placeholder_offsets(SAMPLE + _program((code, 0, 0, PLACEHOLDER_PID)),
                                            PLACEHOLDER_PID, 3)
    for broken in (b"", SAMPLE[:-1], _program((RET, 0, 0, ALLOW)) * 4097):
        with pytest.raises(TemplateError, match="not a BPF program"):
            seccomp_bpf.placeholder_offsets(broken, PLACEHOLDER_PID, 0)


def test_the_template_is_libseccomps_own_program_once_the_pid_is_patched_in() -> None:
    template = seccomp_bpf.build_template(seccomp_rules.build_seccomp_filter)
    flt = seccomp_rules.build_seccomp_filter()
    seccomp_bpf.add_process_rules(flt, os.getpid())
    assert bytes(template.for_pid(os.getpid())) == seccomp_bpf.export_program(flt)
    # libseccomp 2.5 emits one compare with the pid's low half, which the five
    # signal rules share; at most one per rule.
    assert 1 <= len(template.offsets) <= len(seccomp_bpf.SIGNAL_CALLS)
    assert template.program.count(PLACEHOLDER_PID.to_bytes(4, "little")) == len(template.offsets)


def test_a_template_that_fails_verification_is_never_used(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seccomp_bpf, "PLACEHOLDER_PID", CLASHING_PLACEHOLDER)
    prepared = seccomp_bpf.prepare(seccomp_rules.build_seccomp_filter)
    assert prepared is not None and prepared.template is None
    assert prepared.fallback is not None and "not a JEQ" in prepared.why
    assert prepared.describe().startswith("libseccomp in each worker")


SIGNALS = '''
import errno, os, signal, threading
res = {}
sibling = [pid for pid in PIDS if pid != os.getpid()][0]
for name, fn in (("sibling", lambda: os.kill(sibling, 0)),
                 ("placeholder", lambda: os.kill(PLACEHOLDER, 0)),
                 ("self", lambda: os.kill(os.getpid(), 0)),
                 ("own_thread", lambda: signal.pthread_kill(threading.get_ident(), 0))):
    try:
        fn()
        res[name] = "allowed"
    except OSError as exc:
        res[name] = exc.errno
res["sibling_pid"] = sibling
res["pid"] = os.getpid()
result = res
'''


async def _signals(pool: Pool) -> dict[str, Any]:
    pids = pool.worker_pids
    assert len(pids) >= 2   # (the last one may be the compile worker)
    # /proc read from here: the worker opens no file, its own entries included.
    ok, res, status = await exec_seen(pool, SIGNALS.replace("PIDS", repr(pids))
                                      .replace("PLACEHOLDER", str(PLACEHOLDER_PID)))
    assert ok, res
    assert isinstance(res, dict)
    assert res.pop("sibling_pid") in pool.worker_pids   # not hit (signal 0 anyway)
    res.pop("pid")
    res.update(threads=status["threads"], mode=status["status"].get("Seccomp", ""),
               filters=status["status"].get("Seccomp_filters", "1"))
    return res


EXPECTED = {"sibling": errno.EPERM, "placeholder": errno.EPERM, "self": "allowed",
            "own_thread": "allowed", "threads": 1, "mode": "2", "filters": "1"}


def test_a_worker_installs_the_prebuilt_program_and_signals_only_itself() -> None:
    """The fast path in a real worker: the pool says which path installed the filter,
    and the patched filter refuses a sibling (and the placeholder) but not the
    worker itself; the worker is single-threaded (no TSYNC needed), one filter."""
    async def scenario(pool: Pool) -> tuple[dict[str, Any], str]:
        assert pool.hardening["seccomp"], pool.hardening_notes
        return await _signals(pool), pool.hardening_notes.get("seccomp_load", "")

    res, how = run_with_pool(scenario, size=2, _unsafe_test_hooks=True)
    assert how.startswith("prebuilt BPF program"), how
    assert res == EXPECTED, res


def test_without_a_verified_template_workers_load_through_libseccomp_and_say_so(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="sandbox.pool")
    # fresh_interpreter=False: the fork server is a fork of this process and keeps
    # the patch; its template fails verification.
    monkeypatch.setattr(seccomp_bpf, "PLACEHOLDER_PID", CLASHING_PLACEHOLDER)

    async def scenario(pool: Pool) -> tuple[dict[str, Any], str]:
        assert pool.hardening["seccomp"], pool.hardening_notes
        return await _signals(pool), pool.hardening_notes.get("seccomp_load", "")

    res, how = run_with_pool(scenario, size=2, _unsafe_test_hooks=True,
                             fresh_interpreter=False, code_cache_mb=0)
    assert how.startswith("libseccomp in each worker") and "not a JEQ" in how, how
    assert res == EXPECTED, res
    assert any("sandbox seccomp filter: libseccomp" in r.getMessage() for r in caplog.records)
