"""Scripts are compiled once, at save time, in a sandboxed process within a budget
(red-team finding 5): a compile bomb is refused at save with a compile error, never
compiled per request."""
from __future__ import annotations

from typing import Any

import pytest

from models import Script
from sandbox import compile_gate, limits
from service import core
from tests.factories import OWNER, SOURCE, STRANGER, large_source, make_guild

LAMBDA_BOMB = "f = lambda: 0\n" * 10000 + SOURCE  # 140 KB; CPython alone takes ~3 s, 20,000: 10-20 s


def _ordinary_functions(n: int) -> str:
    return "".join(f"def handler_{i}(data):\n    total = 0\n    for item in data:\n"
                   f"        total += item * {i}\n    return {{'total': total}}\n\n"
                   for i in range(n)) + SOURCE


def test_a_compile_bomb_is_refused_at_save_with_a_compile_error(db: Any) -> None:
    gid = make_guild()
    with pytest.raises(core.ValidationError) as err:
        core.create_script(OWNER, gid, "bomb", LAMBDA_BOMB)
    assert err.value.code == "compile_error"
    assert err.value.message == (
        "script does not compile: 2001:5: script takes too long to compile: more than 2000 "
        "functions, lambdas, classes and comprehensions")
    assert Script.select().count() == 0


def finally_in_finally(depth: int) -> str:
    """``try/finally`` nested in ``finally`` blocks: CPython writes each level's
    finally code twice (normal and exceptional way out), 2**depth copies."""
    lines, indent = ["on endpoint(event):", "    x = 0"], "    "
    for _ in range(depth):
        lines += [indent + "try:", indent + "    x = x + 1", indent + "finally:"]
        indent += "    "
    lines += [indent + f"x = x + event.body['a{i}'] * 3 + len(str(x))" for i in range(10)]
    return "\n".join(lines + ["    event.reply(x)"]) + "\n"


def test_a_source_whose_bytecode_explodes_is_refused_at_save(db: Any) -> None:
    # 1.7 KB compiled, within the CPU budget, to 7 MiB of bytecode (here 2 KB: 3.8): no
    # worker could be sent it, and each request killed two workers compiling
    # it again (red-team pass, session 34).
    gid = make_guild()
    bomb = finally_in_finally(11)
    assert len(bomb) < 4000
    with pytest.raises(core.ValidationError) as err:
        core.create_script(OWNER, gid, "bomb", bomb)
    assert err.value.code == "compile_error"
    assert err.value.message.startswith("script does not compile: 1:1: script compiles to ")
    assert err.value.message.endswith(
        " MiB of bytecode, over the 2 MiB limit: a finally block is compiled once for every "
        "way out of its try, so nested try/finally blocks multiply it")
    assert Script.select().count() == 0
    # A few levels, as a script may have, are saved.
    core.create_script(OWNER, gid, "nested", finally_in_finally(4))


def test_the_save_time_checks_run_in_the_compile_process_not_the_service(
        db: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # They parse and walk the source again: in the service that was 1.5 s of
    # its CPU a save of a hostile 97 KB source, holding the GIL up to 0.26 s
    # at a time (red-team pass, session 34). Their findings still refuse or
    # warn exactly as before, from the sandboxed compile.
    from sandbox import checks
    from service.core import script_checks
    calls = _counting(monkeypatch, checks.check_source,
                      (checks, "check_source"), (script_checks, "_check"))
    monkeypatch.setattr(compile_gate, "_verdicts", compile_gate.new_verdicts())
    gid = make_guild()
    view = core.create_script(OWNER, gid, "warned", "on tick(event):\n    pass\n" + SOURCE)
    assert [w["message"] for w in view["warnings"]] == [
        '"on tick" never runs here: this service only emits endpoint']
    with pytest.raises(core.ValidationError) as err:
        core.create_script(OWNER, gid, "refused", "import os\n" + SOURCE)
    assert err.value.code == "compile_error"
    assert err.value.message.startswith("script does not compile: 1:1: import of 'os' is not "
                                        "allowed (allowed: ")
    assert calls == []   # nothing parsed in this process


def _counting(monkeypatch: pytest.MonkeyPatch, real: Any, *places: tuple[Any, str]) -> list[str]:
    """`real` put at each (object, name) of `places`, noting the text of every call."""
    calls: list[str] = []

    def counted(text: str) -> Any:
        calls.append(text)
        return real(text)

    for obj, name in places:
        monkeypatch.setattr(obj, name, counted)
    return calls


def _counting_children(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setattr(compile_gate, "_verdicts", compile_gate.new_verdicts())
    return _counting(monkeypatch, compile_gate._run_child, (compile_gate, "_run_child"))


def test_a_source_over_the_cpu_budget_is_refused_and_remembered(
        db: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Within every static bound, but over a (lowered) CPU budget: the child
    # is ended by SIGPROF wherever it is, and the verdict is kept per source.
    monkeypatch.setattr(limits, "COMPILE_CPU_BUDGET_S", 0.01)
    children = _counting_children(monkeypatch)
    source = _ordinary_functions(1500)
    gid = make_guild()
    for _ in range(2):
        with pytest.raises(core.ValidationError) as err:
            core.create_script(OWNER, gid, "slow", source)
        assert err.value.code == "compile_error"
        assert err.value.message.startswith(
            "script does not compile: 1:1: script takes too long to compile: more than 0.01 s "
            "of CPU time (")
    assert len(children) == 1  # compiled once; the second save got the remembered verdict


def test_a_source_of_countless_errors_is_answered_and_remembered_in_a_few_lines(
        db: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Review, session 26: 45,000 refused names in 135 KB gave as many errors;
    # each refused save kept 2.6 MB in the service (30 MB of its memory per
    # save, 256 verdicts remembered) and answered 8 MB.
    children = _counting_children(monkeypatch)
    source = "_a\n" * 45000 + SOURCE
    gid = make_guild()
    for _ in range(2):
        with pytest.raises(core.ValidationError) as err:
            core.create_script(OWNER, gid, "errors", source)
        message = err.value.message
        assert message.count('"_a" is an invalid variable name') == 20, message[:300]
        assert message.endswith("; 21:1: ... and 44980 more errors from here on "
                                "(fix the ones above first)")
        assert len(message) < 3000
    assert len(children) == 1
    (verdict,) = compile_gate._verdicts.values()
    assert len(verdict.errors) == 21


def test_verdicts_are_remembered_per_guild(db: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A save answered at once because another guild had saved the same text
    # told whether it had (0.03 ms against ~75 ms; review, session 25).
    children = _counting_children(monkeypatch)
    source = "secret_code = 4711\n" + SOURCE
    first, second = make_guild(), make_guild()
    core.create_script(OWNER, first, "a", source)
    core.create_script(OWNER, first, "b", source)
    assert len(children) == 1                    # the guild's own second save: remembered
    core.create_script(OWNER, second, "a", source)
    assert len(children) == 2                    # another guild's: compiled for it


def test_a_stranger_is_refused_before_anything_is_compiled(
        db: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    children = _counting_children(monkeypatch)
    gid = make_guild()
    script_id = core.create_script(OWNER, gid, "mine", SOURCE)["logicScriptId"]
    del children[:]
    for attempt in (lambda: core.create_script(STRANGER, gid, "theirs", "x = 1\n" + SOURCE),
                    lambda: core.update_script(STRANGER, gid, script_id, "y = 1\n" + SOURCE)):
        with pytest.raises((core.PermissionDeniedError, core.NotFoundError)):
            attempt()
    assert children == []


def test_a_compile_process_the_host_failed_is_not_remembered(
        db: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The wall-clock limit says more about a busy host than about the source:
    # the next save compiles it again.
    children = _counting_children(monkeypatch)
    monkeypatch.setattr(compile_gate, "WALL_TIMEOUT_S", 0.001)
    gid = make_guild()
    with pytest.raises(core.ValidationError):
        core.create_script(OWNER, gid, "late", SOURCE)
    monkeypatch.setattr(compile_gate, "WALL_TIMEOUT_S", 30.0)
    assert core.create_script(OWNER, gid, "late", SOURCE)["name"] == "late"
    assert len(children) == 2


def test_an_ordinary_large_script_compiles_within_the_budget(db: Any) -> None:
    # ~250 KB of ordinary functions (~70,000 tokens): 0.6-1.9 s of CPU in the
    # gate on an idle host, over 3 s on a virtual machine with busy neighbours
    # (the budget is 5 s).
    source = large_source()
    assert 240_000 < len(source) < 262_144
    gid = make_guild()
    view = core.create_script(OWNER, gid, "large", source)
    assert view["sourceBytes"] == len(source)


def test_another_guilds_saves_do_not_push_a_guilds_verdicts_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # One shared list of 256 verdicts: 256 saves of one guild pushed the others'
    # out, so a guild re-saving its own text could tell (a compile, or not)
    # whether any other guild had saved meanwhile (review, session 29).
    children = _counting_children(monkeypatch)
    assert compile_gate.check_source("x = 'theirs'\n", "B").ok
    for i in range(300):
        assert compile_gate.check_source(f"x = {i}\n", "A").ok
    compiled = len(children)
    assert compile_gate.check_source("x = 'theirs'\n", "B").ok
    assert len(children) == compiled          # still remembered: not compiled again
    assert compile_gate.check_source("x = 299\n", "A").ok
    assert len(children) == compiled          # A's newest are remembered ...
    assert compile_gate.check_source("x = 0\n", "A").ok
    assert len(children) == compiled + 1      # ... its oldest made room for them


def test_memory_over_the_compile_cap_is_refused(db: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "COMPILE_MEMORY_BYTES", 2 << 20)
    monkeypatch.setattr(compile_gate, "_verdicts", compile_gate.new_verdicts())
    gid = make_guild()
    with pytest.raises(core.ValidationError) as err:
        core.create_script(OWNER, gid, "big", _ordinary_functions(300))
    assert err.value.message == ("script does not compile: 1:1: script needs more than 2 MB "
                                 "of memory to compile")


def test_the_compile_process_hardens_itself_like_a_worker() -> None:
    # What the one-shot process can do once hardened, seen from inside it.
    import json
    import os
    import subprocess
    import sys

    probe = r'''
import json, os, socket, sys
from sandbox import compile_gate, limits
status_fd = os.open("/proc/self/status", os.O_RDONLY)   # before: nothing opens after
compile_gate._harden({"mem": limits.COMPILE_MEMORY_BYTES, "cpu": 3.0, "uid": 65534, "gid": 65534})
seen = {"uid": os.geteuid()}
import resource, time
seen["cpu_limit"] = list(resource.getrlimit(resource.RLIMIT_CPU))
while time.process_time() < 2.5:   # a compile that takes most of a 3 s budget
    pass
seen["cpu_used"] = time.process_time()
try:
    open("/etc/passwd", "rb").close()
    seen["read"] = "allowed"
except OSError as exc:
    seen["read"] = exc.errno
try:
    os.stat("/etc/passwd")
    seen["stat"] = "allowed"
except OSError as exc:
    seen["stat"] = exc.errno
try:
    socket.socket()
    seen["socket"] = "allowed"
except OSError as exc:
    seen["socket"] = exc.errno
try:
    open("/tmp/compile-gate-probe", "w")
    seen["write"] = "allowed"
except OSError as exc:
    seen["write"] = exc.errno
status = dict(line.split(":", 1) for line in os.pread(status_fd, 1 << 16, 0).decode().splitlines()
              if ":" in line)
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
seen["unset_parent_death_signal"] = (libc.prctl(1, 0, 0, 0, 0), ctypes.get_errno())
seen["no_new_privs"] = status["NoNewPrivs"].strip()
seen["seccomp"] = status["Seccomp"].strip()
seen["environ"] = dict(os.environ)
sys.stdout.write(json.dumps(seen))
'''
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True,
                          text=True, timeout=60, check=True, env={"SECRET": "x"})
    seen = json.loads(proc.stdout)
    assert seen["socket"] == 1 and seen["write"] == 1  # EPERM from seccomp
    # It dies with the compile server that enforces its wall-clock limit, and
    # cannot undo that (review, session 27: a taken-over compile outlived it).
    assert seen["unset_parent_death_signal"] == [-1, 1]
    from sandbox import landlock
    # EACCES from Landlock where the kernel has it (the compile opens no file).
    assert seen["read"] == (13 if landlock.abi_version() else "allowed")
    assert seen["no_new_privs"] == "1" and seen["seccomp"] == "2"
    assert seen["environ"] == {}
    # The whole budget, and the kernel's backstop just past it: a compile of
    # 2.5 s of CPU under a 3 s budget is not ended by RLIMIT_CPU (a worker's
    # 2 s window, which it moves forward per job, ended such compiles as
    # "more than 3 s").
    assert seen["cpu_limit"] == [5, 5] and seen["cpu_used"] >= 2.5
    if os.geteuid() == 0:
        assert seen["uid"] == 65534
        assert seen["stat"] == 13    # an empty root that only root may search: EACCES


def test_a_compile_process_without_a_layer_says_so(caplog, monkeypatch) -> None:
    # Outside review, session 17: the compile process went on without its
    # empty root when none could be made, and nothing said so.
    import json
    import os
    import subprocess
    import sys

    from sandbox import compile_gate
    probe = r'''
import errno, json, os, sys, tempfile
from sandbox import compile_gate, limits
def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")
tempfile.mkdtemp = no_space
inactive = compile_gate._harden({"mem": limits.COMPILE_MEMORY_BYTES, "cpu": 3.0,
                                 "uid": 65534, "gid": 65534})
sys.stdout.write(json.dumps(inactive))
'''
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True,
                          text=True, timeout=60, check=True, env={})
    inactive = json.loads(proc.stdout)
    if os.geteuid() == 0:
        assert inactive["empty_root"] == "no empty directory could be made (No space left on device)"
    else:
        assert inactive["empty_root"].startswith("not started as root")
    # The service logs each missing layer once, and the operator's check shows them.
    monkeypatch.setattr(compile_gate, "_inactive", {})
    caplog.set_level("WARNING", logger="sandbox.compile_gate")
    compile_gate._note_inactive(inactive)
    compile_gate._note_inactive(inactive)
    lines = [r.getMessage() for r in caplog.records if "empty_root is NOT active" in r.getMessage()]
    assert len(lines) == 1, lines
    assert compile_gate.inactive_layers()["empty_root"] == inactive["empty_root"]


@pytest.mark.parametrize("answer", [
    b'{"errors": [[Infinity, 1, "x"]], "over": false}',
    b'{"errors": [], "warnings": [[1, -Infinity, "x"]], "over": false}',
    b'{"errors": [], "warnings": "not a list", "over": false}',
])
def test_a_compile_process_answering_nonsense_fails_the_save_cleanly(
        db: Any, monkeypatch: pytest.MonkeyPatch, answer: bytes) -> None:
    # A compile process taken over through a parser bug may answer anything: a
    # number JSON calls Infinity as a line made int() raise OverflowError, a
    # 500 with a traceback instead of a refused save (review, session 34).
    monkeypatch.setattr(compile_gate, "_verdicts", compile_gate.new_verdicts())
    monkeypatch.setattr(compile_gate, "_ask_server",
                        lambda params, source: (answer, b'{"code": 0, "signal": 0, "wall": false}'))
    with pytest.raises(core.ValidationError) as err:
        core.create_script(OWNER, make_guild(), "s", SOURCE)
    assert err.value.message == ("script does not compile: 1:1: the script could not be "
                                 "compiled (compile process answered nonsense)")
