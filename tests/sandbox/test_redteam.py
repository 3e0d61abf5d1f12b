"""Independent red-team review of the sandbox (docs/security.md, "Review findings").

Every case is an attack a hostile script author (or, for the OS and protocol
sections, a compromised worker) would try, through the real entry points:
``compile_script`` + ``run_endpoint`` in-process, ``Pool`` end to end, and the
pool's test hook for unrestricted code inside a hardened worker.  Each test
asserts the attack FAILS and nothing leaked.  Cases that already failed before
the review are kept as regression tests; the ones that succeeded are marked
with their finding number (R1-R8) and were fixed in the sandbox.
"""
from __future__ import annotations

import asyncio
import errno
import gc
import importlib
import math
import os
import re
import sys
import textwrap
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from sandbox import protocol
from sandbox.compiler import compile_script
from sandbox.errors import ProtocolError
from sandbox.pool import Limits, Pool
from sandbox.runtime import RunReport, run_endpoint
from tests.sandbox.poolkit import event as pool_event
from tests.sandbox.poolkit import exec_seen, ref, run_with_pool, settled_workers
from tests.sandbox.script_helpers import block, error_kind, make_event

SECRET = "redteam-secret-5be0c2"
TRUSTED_SECRET = SECRET  # a module global of trusted code: must never be reachable


def _run(source: str, event: dict[str, Any] | None = None) -> tuple[dict[str, Any], RunReport]:
    report = RunReport()
    result = compile_script(textwrap.dedent(source))
    assert result.ok and result.script is not None, result.errors
    out = run_endpoint(result.script, event if event is not None else make_event(),
                       report=report)
    return out, report


def _assert_plain(value: Any, depth: int = 0) -> None:
    """The result holds plain data only, and no secret of the trusted process."""
    assert depth < 40
    if isinstance(value, dict):
        for key, item in value.items():
            assert type(key) is str
            _assert_plain(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _assert_plain(item, depth + 1)
    else:
        assert type(value) in (str, int, bool, bytes, float, type(None)), type(value)
        if type(value) in (str, bytes):
            needle = SECRET if type(value) is str else SECRET.encode()
            assert needle not in value  # type: ignore[operator]


@pytest.fixture
def unraisable() -> Iterator[list[str]]:
    """Records script finalisers that run outside the runtime's own clean-up.

    Also keeps pytest's own hook (which holds the exception, its traceback
    and so the script's frames) from keeping script code alive.
    """
    seen: list[str] = []
    old = sys.unraisablehook

    def hook(info: Any) -> None:
        seen.append(f"{type(info.exc_value).__name__}: {info.exc_value}")

    sys.unraisablehook = hook
    try:
        yield seen
    finally:
        sys.unraisablehook = old


# ---------------------------------------------------------------------------
# R1: script code outliving its invocation inside process-wide caches
# ---------------------------------------------------------------------------

# A str subclass instance carries a suspended generator; a library keeps the
# instance in a process-wide cache; on eviction, during another guild's
# invocation, the generator's finally block runs there.
ARMED = '''
import re, time, datetime, string, json
class S(str):
    pass
def gen():
    try:
        yield 1
    finally:
        raise ValueError("ran late")
def armed(text):
    s = S(text)
    g = gen()
    next(g)
    s.g = g
    return s
'''

# (id, statement, whether a library still holds the object afterwards).
# Routes through our module wrappers hand libraries exact str copies (nothing
# is kept); routes through C methods of objects cannot be wrapped and are
# caught by the runtime's leftover check (the worker then retires).
CACHE_ROUTES: list[tuple[str, str, bool]] = [
    ("re.compile", 're.compile(armed("r1-a"))', False),
    ("re.search", 're.search(armed("r1-b"), "x")', False),
    ("re.match", 're.match(armed("r1-c"), "x")', False),
    ("re.fullmatch", 're.fullmatch(armed("r1-d"), "x")', False),
    ("re.split", 're.split(armed("r1-e"), "x")', False),
    ("re.findall", 're.findall(armed("r1-f"), "x")', False),
    ("re.finditer", 're.finditer(armed("r1-g"), "x")', False),
    ("re.sub-pattern", 're.sub(armed("r1-h"), "y", "x")', False),
    ("re.sub-template", 're.sub("x", armed("\\\\g<0>r1"), "x")', False),
    ("re.subn-template", 're.subn("x", armed("\\\\g<0>r2"), "x")', False),
    ("time.strptime", 'time.strptime("2020", armed("%Y"))', False),
    ("template-pattern", '''
class T(string.Template):
    pattern = armed("(?P<escaped>@@)|(?P<named>[a-z]+)|(?P<braced>@@@)|(?P<invalid>@@@@)")
T("a").substitute(a=1)''', False),
    ("pattern-method-sub-template", 're.compile("x").sub(armed("\\\\g<0>r3"), "x")', True),
    ("datetime-strptime", 'datetime.datetime.strptime("2021 r1", armed("%Y r1"))', True),
    ("json-loads", 'json.loads(armed("{}"))', False),
    ("strftime", 'datetime.date(2020, 1, 1).strftime(armed("%Y"))', False),
]


@pytest.mark.parametrize("statement,kept", [(s, k) for _, s, k in CACHE_ROUTES],
                         ids=[i for i, _, _ in CACHE_ROUTES])
def test_r1_script_objects_left_in_library_caches_are_detected(
        statement: str, kept: bool, unraisable: list[str]) -> None:
    out, report = _run(ARMED + "on endpoint(event):\n" + textwrap.indent(
        textwrap.dedent(statement).strip("\n"), "    ") + "\n    event.reply(1)\n")
    assert out["error"] is None, out["error"]
    # Exactly the routes no wrapper can cover leave something behind, and the
    # runtime notices every one of them.
    assert report.leaked is kept
    if kept:
        # What the worker's retirement prevents: evicting the entry (here by
        # hand) runs the script's finally block in whoever is running then.
        unraisable.clear()
        re.purge()
        importlib.import_module("_strptime")._regex_cache.clear()
        gc.collect()
        assert "ValueError: ran late" in unraisable


def test_r1_the_original_attack_no_longer_runs_in_the_next_invocation(
        unraisable: list[str]) -> None:
    # The attack as found: fill re's 512-entry cache behind the armed pattern
    # so that the next new pattern anyone compiles evicts it.
    attack = ARMED + block('''
        re.compile(armed("r1-original"))
        for i in range(511):
            re.compile("r1-filler-%d" % i)
        event.reply("ok")''')
    victim = block('re.compile("r1-victim-pattern")\nevent.reply("victim")', "import re\n")
    out, report = _run(attack)
    assert out["body"] == b'"ok"' and not report.leaked
    unraisable.clear()  # the attack's own objects die inside its own invocation
    out, _ = _run(victim)
    assert out["body"] == b'"victim"'
    assert not [u for u in unraisable if "ran late" in u]


def test_r1_plain_scripts_are_not_reported_as_leaking(unraisable: list[str]) -> None:
    # Classes, closures, caught exceptions with tracebacks (cycles through
    # frames), generators finished or not: the runtime cleans all of them up.
    for source in (
        block("event.reply(1)"),
        block("class C:\n    def f(self):\n        return 1\nevent.reply(C().f())"),
        block("try:\n    1 / 0\nexcept Exception as exc:\n    keep = exc\nevent.reply(1)"),
        block("def g():\n    yield 1\nx = g()\nnext(x)\nevent.reply(1)"),
        block("f = lambda: f\ncache = functools.lru_cache(f)\ncache()\nevent.reply(1)",
              "import functools\n"),
        block("raise ValueError('boom')"),
    ):
        _, report = _run(source)
        assert not report.leaked, source


def test_r1_a_worker_that_leaked_script_code_is_retired_before_the_next_job() -> None:
    # A generator that would spin forever when finalised late.
    attack = ARMED.replace('raise ValueError("ran late")', "while True:\n            pass") + \
        block('re.compile("x").sub(armed("\\\\g<0>late"), "x")\nevent.reply("armed")')
    victim = block('''
        for i in range(600):
            re.compile("x").sub("\\\\g<0>%d" % i, "x")
        event.reply("victim ok")''', "import re\n")

    async def scenario(pool: Pool) -> None:
        before = pool.worker_pids
        first = await pool.run(ref(attack), pool_event(), Limits(1000, 4096))
        assert first.body == b'"armed"'
        for _ in range(200):
            if pool.worker_pids and pool.worker_pids != before:
                break
            await asyncio.sleep(0.01)
        assert pool.worker_pids != before  # the worker exited after its reply
        second = await pool.run(ref(victim), pool_event(), Limits(1000, 4096))
        assert second.error_kind is None and second.body == b'"victim ok"'

    run_with_pool(scenario, size=1)


# ---------------------------------------------------------------------------
# R2: memory disclosure through writable C slots of builtin exception bases
# ---------------------------------------------------------------------------

SLOT_ATTACKS: list[tuple[str, str]] = [
    ("decode-error-object-list", '''
class E(UnicodeDecodeError):
    def __init__(self):
        pass
e = E()
e.object = [0] * 1000
e.encoding = "x"
e.reason = "r"
e.start = -64
e.end = -63
event.reply(str(e))'''),
    ("encode-error-object-list", '''
class E(UnicodeEncodeError):
    def __init__(self):
        pass
e = E()
e.object = [0] * 100
e.encoding = "x"
e.reason = "r"
e.start = 3
e.end = 4
event.reply(str(e))'''),
    ("unicode-error-via-script-base", '''
class A(Exception):
    pass
class E(A, UnicodeDecodeError):
    pass'''),
    ("unicode-error-via-type-of-instance", '''
try:
    b"\\xff".decode("utf-8")
except UnicodeDecodeError as exc:
    class E(type(exc)):
        pass'''),
]


@pytest.mark.parametrize("body", [b for _, b in SLOT_ATTACKS], ids=[i for i, _ in SLOT_ATTACKS])
def test_r2_unicode_error_subclasses_are_refused(body: str) -> None:
    out, _ = _run(block(body))
    assert error_kind(out) == "script_error"
    assert "classes cannot derive from Unicode" in out["error"]["message"]
    _assert_plain(out)


# OSError.__str__ formats errno, strerror and filename from borrowed pointers:
# str(errno) ran script code (a date subclass's isoformat) that rebound a
# subclass instance's filename, and the freed object was formatted next (red
# team, session 35: the freed list's memory read back as a newer list; with a
# forged type, the worker jumped to an address the script chose).
OSERROR_STR = '''
import time, datetime
st = {"e": None, "keep": None}
try:
    time.gmtime(10 ** 17)
except Exception as caught:
    OSE = type(caught)
class E(OSE):
    pass
class D(datetime.date):
    def isoformat(self):
        e = st["e"]
        if e is not None:
            st["e"] = None
            e.filename = None
            st["keep"] = ["made after the free"]
        return "1"
on endpoint(event):
    e = E(1, "x")
    e.errno = D(2000, 1, 1)
    e.filename = ["original filename"]
    st["e"] = e
    event.reply(str(e))
'''


def test_r2_oserror_subclasses_are_refused_so_its_str_never_formats_freed_memory() -> None:
    async def scenario(pool: Pool) -> None:
        out = await pool.run(ref(OSERROR_STR), pool_event(), Limits(1000, 8192))
        assert out.error_kind == "script_error", (out.error_kind, out.body)
        assert "classes cannot derive from OSError" in (out.error_message or "")
        # A plain OSError keeps its str and stays read-only.
        plain = await pool.run(ref(block('''
            try:
                time.gmtime(10 ** 17)
            except Exception as caught:
                e = type(caught)(1, "x", ["f"])
                try:
                    e.filename = None
                except TypeError:
                    event.reply(str(e))''', "import time\n")), pool_event(), Limits(1000, 8192))
        assert plain.error_kind is None and plain.body == b'"[Errno 1] x: [\'f\']"', plain

    run_with_pool(scenario, size=1)


# Library methods read from a class are plain functions: called on any object,
# library code did what the guards refuse (red team, session 35).
UNBOUND_GADGETS = [
    ("setstate-writes-a-library-class", """
try:
    random.Random.setstate(collections.Counter, (3, (), "left behind"))
except TypeError as e:
    caught = str(e)
try:
    collections.Counter.gauss_next
    left = True
except AttributeError:
    left = False
event.reply([caught, left])""",
     b'["Random.setstate() must be called on a Random object",false]'),
    ("gauss-writes-a-library-class", """
try:
    random.Random.gauss(collections.OrderedDict)
except TypeError as e:
    event.reply(str(e))""", b'"Random.gauss() must be called on a Random object"'),
    ("copy-hands-out-type", "event.reply(repr(collections.Counter.copy(int)))", None),
    ("copy-through-a-script-subclass", """
class S(collections.Counter):
    pass
event.reply(repr(S.copy(int)))""", None),
    ("copy-through-super", """
class S(collections.Counter):
    pass
event.reply(repr(super(S, S).copy(int)))""", None),
    ("chainmap-new-child", "event.reply(repr(collections.ChainMap.new_child(int)))", None),
    # A review: functools' cache copied the cached class's __dict__ onto its
    # wrapper, handing the raw methods out again.
    ("copy-through-cache", "event.reply(repr(functools.cache(collections.Counter).copy(int)))",
     "object has no attribute 'copy'"),
    # Another review: a library property's getter, raw, called on a script
    # class whose `maps` it read: ScriptType(name, bases, dict) with any dunder.
    ("property-fget", """
class Maker:
    maps = None
Maker.maps = [None, "X", (object,), {"__str__": lambda self: "script-written"}]
event.reply(str(collections.ChainMap.parents.fget(Maker)()))""",
     '"fget" of a library property is not available'),
    # A third review: classmethod() chains to what it wraps, so a library
    # property given to it ran its getter on the script's class.
    ("classmethod-of-a-library-property", """
class Maker:
    build = classmethod(collections.ChainMap.parents)
    maps = [0, "Loose", (), {}]
event.reply(repr(Maker.build))""", "classmethod() takes a function here"),
    ("uuid-property-fget", "event.reply(repr(uuid.UUID.hex.fget))",
     '"fget" of a library property is not available'),
    ("setstate-through-lru-cache", """
functools.lru_cache(random.Random).setstate(collections.Counter, (3, (), "left"))""",
     "object has no attribute 'setstate'"),
]


LEFT_ON_COUNTER = """
try:
    collections.Counter.gauss_next
    event.reply(True)
except AttributeError:
    event.reply(False)"""


@pytest.mark.parametrize("body,expected", [(b, e) for _, b, e in UNBOUND_GADGETS],
                         ids=[i for i, _, _ in UNBOUND_GADGETS])
def test_library_methods_read_from_a_class_check_what_they_are_called_on(
        body: str, expected: bytes | str | None) -> None:
    source = block(body, "import collections\nimport functools\nimport random\nimport uuid\n")

    async def scenario(pool: Pool) -> None:
        out = await pool.run(ref(source), pool_event(), Limits(1000, 8192))
        if not isinstance(expected, bytes):
            assert out.error_kind == "script_error", (out.error_kind, out.body)
            assert (expected or "must be called on a") in (out.error_message or ""), \
                out.error_message
        else:
            assert out.error_kind is None and out.body == expected, (out.error_kind, out.body)
        again = await pool.run(ref(block(LEFT_ON_COUNTER, "import collections\n")), pool_event(),
                               Limits(1000, 8192))
        assert again.body == b"false"           # nothing left for the next request
        assert pool.counters["crashes"] == 0

    run_with_pool(scenario, size=1)


def test_a_class_made_from_a_namespace_holds_only_what_a_class_body_can_define() -> None:
    # Defence behind the property check: ScriptType(name, bases, dict) reached
    # through library code may not add special methods a class body cannot.
    from sandbox.guards import ScriptType
    with pytest.raises(TypeError, match="cannot define '__str__'"):
        ScriptType("X", (object,), {"__str__": lambda self: "x"})
    with pytest.raises(TypeError, match="cannot define"):
        ScriptType("X", (object,), {1: 2})

    class Hiding(dict):      # keys() hid __eq__ from the comparison wrapping
        def keys(self) -> Any:
            return []
    with pytest.raises(TypeError, match="namespace must be a dict"):
        ScriptType("X", (object,), Hiding({"__eq__": lambda self, other: NotImplemented}))
    made = ScriptType("X", (object,), {"__module__": "m", "__qualname__": "X", "__doc__": "d",
                                       "__init__": lambda self: None, "n": 1,
                                       "__eq__": lambda self, other: True})
    assert made.n == 1 and made() == made()


def test_library_methods_read_from_a_class_still_work_on_their_instances() -> None:
    source = block("""
class Codec:
    encode = json.dumps
    chain = itertools.chain
class Memo:
    @functools.cache
    def fib(n):
        return n if n < 2 else Memo.fib(n - 1) + Memo.fib(n - 2)
class S(collections.Counter):
    pass
class P:
    def get(self):
        return 3
    p = property(get)
    def make(cls):
        return 7 if cls is P else 0
    made = classmethod(make)
c = collections.Counter("abca")
s = S("xyx")
r = random.Random(5)
random.Random.setstate(r, random.Random(5).getstate())
event.reply([collections.Counter.most_common(c, 1), type(S.copy(s)) is S,
             type(super(S, S).copy(s)) is S, collections.Counter.copy(s) == s,
             r.random() == random.Random(5).random(), Codec.encode({"a": 1}),
             list(Codec.chain([1], [2])), Memo.fib(10), P.p.fget(P()), P().p, P.made(),
             uuid.UUID(int=5).hex[-2:]])""",
                   "import collections\nimport functools\nimport itertools\nimport json\n"
                   "import random\nimport uuid\n")

    async def scenario(pool: Pool) -> None:
        out = await pool.run(ref(source), pool_event(), Limits(1000, 8192))
        assert out.error_kind is None, (out.error_kind, out.error_message)
        assert out.body == b'[[["a",2]],true,true,true,true,"{\\"a\\": 1}",[1,2],55,3,3,7,"05"]', out.body

    run_with_pool(scenario, size=1)


def test_r2_real_unicode_errors_stay_read_only_and_usable() -> None:
    out, _ = _run(block('''
        try:
            b"\\xff".decode("utf-8")
        except UnicodeDecodeError as exc:
            caught = str(exc)
            try:
                exc.object = [0] * 10
            except TypeError:
                event.reply([caught, "read-only"])'''))
    assert out["body"] == (b'["\'utf-8\' codec can\'t decode byte 0xff in position 0: '
                           b'invalid start byte","read-only"]')


# The same read without a subclass (security review, session 16): the
# constructors took any start and end, and ``__str__`` reads the object at
# ``start`` checking only ``start < len``.
CONSTRUCTOR_ATTACKS: list[tuple[str, str]] = [
    ("decode-error-negative-start", 'UnicodeDecodeError("x", b"A" * 16, -4096, -4095, "r")'),
    ("decode-error-end-past-object", 'UnicodeDecodeError("x", b"A", 0, 2, "r")'),
    ("encode-error-negative-start", 'UnicodeEncodeError("x", "A" * 16, -40, -39, "r")'),
    ("decode-error-via-type-of-instance",
     'type(caught)("x", b"A" * 16, -4096, -4095, "r")'),
    ("encode-error-via-type-of-instance",
     'type(caught_encode)("x", "A", -400, -399, "r")'),
]


@pytest.mark.parametrize("call", [c for _, c in CONSTRUCTOR_ATTACKS],
                         ids=[i for i, _ in CONSTRUCTOR_ATTACKS])
def test_unicode_error_constructors_refuse_a_range_outside_the_object(call: str) -> None:
    out, _ = _run(block(f'''
        try:
            b"\\xff".decode("utf-8")
        except UnicodeDecodeError as exc:
            caught = exc
        try:
            "\\u20ac".encode("ascii")
        except UnicodeEncodeError as exc:
            caught_encode = exc
        event.reply(str({call}))'''))
    assert error_kind(out) == "script_error", out
    assert "start and end must satisfy 0 <= start <= end <= len(object)" in \
        out["error"]["message"]
    assert "body" not in out or not out["body"]


def test_the_range_check_also_holds_for_later_subclasses_and_explicit_init() -> None:
    # Review of the fix: a subclass made after the check was installed took
    # its tp_init from the `__init__` slot wrapper, which still held the
    # unchecked constructor (scripts cannot subclass these; trusted code can).
    from sandbox import guards
    assert guards.UNICODE_ERRORS_CHECKED

    class Later(UnicodeDecodeError):
        pass

    for build in (lambda: Later("x", b"A", -4096, -4095, "r"),
                  lambda: UnicodeDecodeError.__init__(UnicodeDecodeError("x", b"A", 0, 1, "r"),
                                                      "x", b"A", -9, -8, "r"),
                  lambda: UnicodeTranslateError("A", -3, -2, "r")):
        with pytest.raises(ValueError, match="0 <= start <= end <= len"):
            build()
    assert str(Later("utf-8", b"\xff", 0, 1, "bad")) == \
        "'utf-8' codec can't decode byte 0xff in position 0: bad"


def test_unicode_errors_a_script_builds_in_range_still_work() -> None:
    out, _ = _run(block('''
        made = UnicodeDecodeError("utf-8", b"\\xffA", 0, 1, "invalid start byte")
        try:
            raise made
        except UnicodeDecodeError as exc:
            decoded = str(exc)
        encoded = str(UnicodeEncodeError("ascii", "a\\u20ac", 1, 2, "no"))
        event.reply([decoded, encoded, isinstance(made, UnicodeError)])'''))
    assert out["body"] == (b'["\'utf-8\' codec can\'t decode byte 0xff in position 0: '
                           b'invalid start byte","\'ascii\' codec can\'t encode character '
                           b'\'\\\\u20ac\' in position 1: no",true]'), out


def test_without_the_range_check_scripts_cannot_reach_the_unicode_error_classes() -> None:
    # The extension missing (no compiler at install): the classes' names
    # are not builtins and type() of such an error is refused; UnicodeError
    # still catches them.
    import subprocess
    probe = textwrap.dedent('''
        import sys
        sys.modules["sandbox._unicode_errors"] = None
        from sandbox import guards
        from sandbox.compiler import compile_script
        from sandbox.runtime import run_endpoint
        from tests.sandbox.script_helpers import make_event
        src = """
        on endpoint(event):
            seen = []
            for name in ("UnicodeDecodeError", "UnicodeEncodeError"):
                try:
                    eval_name = {"UnicodeDecodeError": lambda: UnicodeDecodeError,
                                 "UnicodeEncodeError": lambda: UnicodeEncodeError}[name]()
                    seen.append("named")
                except NameError:
                    seen.append("absent")
            try:
                b"\\\\xff".decode("utf-8")
            except UnicodeError as exc:
                try:
                    type(exc)
                    seen.append("typed")
                except TypeError:
                    seen.append("type refused")
            event.reply(seen)
        """
        import textwrap
        r = compile_script(textwrap.dedent(src))
        print(guards.UNICODE_ERRORS_CHECKED, run_endpoint(r.script, make_event())["body"].decode())
    ''')
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True,
                          text=True, timeout=60, check=True)
    assert proc.stdout.split() == ["False", '["absent","absent","type', 'refused"]'], proc


# ---------------------------------------------------------------------------
# R3: re flags past the wrappers (string.Template subclasses)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("flags", ["128", "4", "128 | 2", "re.I | 128"],
                         ids=["debug", "locale", "debug-ignorecase", "debug-flag-object"])
def test_r3_template_subclass_cannot_use_debug_or_locale_flags(
        flags: str, capfd: pytest.CaptureFixture[str]) -> None:
    out, _ = _run("import re, string\nclass T(string.Template):\n    flags = %s\n"
                  "on endpoint(event):\n    event.reply(1)\n" % flags)
    assert error_kind(out) == "script_error"
    assert "unsupported re flag" in out["error"]["message"]
    captured = capfd.readouterr()
    assert "LITERAL" not in captured.out + captured.err  # re.DEBUG's dump


@pytest.mark.parametrize("attribute", [
    "flags = classmethod(property(lambda cls: reads.append(1) or (0 if len(reads) == 1 else 128)))",
    "pattern = classmethod(property(lambda cls: reads.append(1) or Sub(r'\\$(?P<named>x)')))",
    "delimiter = classmethod(property(lambda cls: reads.append(1) or '$'))",
], ids=["flags", "pattern", "delimiter"])
def test_r3_a_template_attribute_is_read_once_and_checked_as_read(
        attribute: str, capfd: pytest.CaptureFixture[str]) -> None:
    # The check read flags as 0 and string.Template's own __init_subclass__
    # read them again as re.DEBUG (review, session 25): values are now taken
    # from the class dictionaries, no descriptor runs, and only plain strings
    # and flags pass.
    out, _ = _run("import re, string\nreads = []\nclass Sub(str):\n    pass\n"
                  "class T(string.Template):\n    %s\n"
                  "on endpoint(event):\n    event.reply(len(reads))\n" % attribute)
    assert error_kind(out) == "script_error" and "TypeError" in out["error"]["message"]
    captured = capfd.readouterr()
    assert "LITERAL" not in captured.out + captured.err  # re.DEBUG's dump


def test_r3_template_still_works_for_scripts() -> None:
    out, _ = _run(block('''
        class Dollar(string.Template):
            delimiter = "%"
        class Braced(Dollar):
            braceidpattern = "[a-z]+[0-9]"
            flags = re.IGNORECASE
        class EmptyBrace(string.Template):
            braceidpattern = ""
        class Whole(string.Template):
            delimiter = "@"
            pattern = r"@(?:(?P<escaped>@)|(?P<named>[a-z]+)|{(?P<braced>[a-z]+)}|(?P<invalid>))"
        t = string.Template("$who likes $what")
        event.reply([t.substitute(who="ada", what="maths"), Dollar("%x!").substitute(x=1),
                     isinstance(t, string.Template), isinstance(Dollar("x"), string.Template),
                     Braced("%{AB1} %Y").substitute(AB1=2, Y=3), Whole("@a @@").substitute(a=4),
                     EmptyBrace("${ab} $cd").safe_substitute(ab=5, cd=6)])''',
        "import re, string\n"))
    assert out["body"] == b'["ada likes maths","1!",true,true,"2 3","4 @","5 6"]'


# ---------------------------------------------------------------------------
# Reaching trusted objects: classic and less known routes (already refused)
# ---------------------------------------------------------------------------

REACH: list[tuple[str, str, str]] = [
    # (id, body, prelude)
    ("exception-context", "try:\n    json.loads('x')\nexcept Exception as e:\n"
                          "    event.reply(e.__context__)", "import json\n"),
    ("exception-traceback-frame", "try:\n    1/0\nexcept Exception as e:\n"
                                  "    event.reply(e.__traceback__)", ""),
    ("stopiteration-value-of-trusted-gen", "it = iter([])\ntry:\n    next(it)\n"
                                           "except StopIteration as e:\n    event.reply(e.value)", ""),
    ("json-dumps-cls-kwargs", "event.reply(json.dumps(1, cls=type(event)))", "import json\n"),
    ("json-object-hook-frame", "event.reply(json.loads('{}', object_hook=lambda d: d.gi_frame))",
     "import json\n"),
    ("partial-func-of-guard", "p = functools.partial(len)\nevent.reply(p.func.__self__)",
     "import functools\n"),
    ("lru-cache-wrapped", "c = functools.lru_cache(json.dumps)\nevent.reply(c.__wrapped__)",
     "import functools, json\n"),
    ("lru-cache-dict", "c = functools.lru_cache(json.dumps)\nevent.reply(c.__dict__)",
     "import functools, json\n"),
    ("namedtuple-module-builtins", "P = collections.namedtuple('P', 'a', module='builtins')\n"
                                   "event.reply(P.__module__)", "import collections\n"),
    ("method-type-rebind", "M = type(event.reply)\nm = M(json.dumps, event)\nevent.reply(m())",
     "import json\n"),
    ("function-type-needs-code", "F = type(lambda: 0)\nevent.reply(F(None, {}))", ""),
    ("property-fget-trusted", "p = property(json.dumps)\nevent.reply(p.fget.__globals__)",
     "import json\n"),
    ("classmethod-func", "c = classmethod(len)\nevent.reply(c.__func__)", ""),
    ("super-thisclass", "class A:\n    pass\nevent.reply(super(A, A()).__thisclass__)", ""),
    ("super-self-class", "class A:\n    pass\nevent.reply(super(A, A()).__self_class__)", ""),
    ("uuid-is-safe-enum-class", "u = uuid.uuid4()\nE = type(u.is_safe)\nevent.reply(E._member_map_)",
     "import uuid\n"),
    ("regexflag-enum-metaclass", "T = type(type(re.I))\nevent.reply(T)", "import re\n"),
    ("template-pattern-module", "event.reply(string.Template.pattern.__class__)",
     "import string\n"),
    ("match-re-module", "m = re.match('a', 'a')\nevent.reply(m.re.__module__)", "import re\n"),
    ("random-class-module", "event.reply(random.Random.seed.__globals__)", "import random\n"),
    ("random-bound-self", "event.reply(random.random.__self__)", "import random\n"),
    ("hmac-digest-cons", "h = hmac.new(b'k', b'm', 'sha256')\nevent.reply(h._hmac)",
     "import hmac\n"),
    ("hmac-module-digestmod", "class M:\n    def new(self, d=b''):\n        return d\n"
                              "h = hmac.new(b'k', b'm', M())\nevent.reply(h.name)", "import hmac\n"),
    ("decimal-context-of-current", "d = decimal.Decimal(1) / 3\nevent.reply(d.__reduce__())",
     "import decimal\n"),
    ("statistics-fraction-class", "event.reply(type(statistics.mean([1, 2])).__subclasses__())",
     "import statistics\n"),
    ("datetime-tzinfo-utcoffset-arg", "class Z(datetime.tzinfo):\n"
                                      "    def utcoffset(self, dt):\n        return dt.__class__\n"
                                      "event.reply(str(datetime.datetime.now(Z())))",
     "import datetime\n"),
    ("generator-throw-traceback", "def g():\n    yield 1\nx = g()\nnext(x)\n"
                                  "event.reply(x.throw(ValueError, None, 'tb'))", ""),
    ("percent-mapping-attr", "event.reply('%(__class__)s' % {'a': 1})", ""),
    ("format-spec-attr", "event.reply(format(event, '{0.__class__}'))", ""),
    ("fstring-conversion-attr", "x = event\nevent.reply(f'{x!r:>{10}}')", ""),
    ("str-translate-defaultdict", "d = collections.defaultdict(lambda: 'x')\n"
                                  "event.reply('ab'.translate(d))", "import collections\n"),
    ("import-via-c-fromlist-list", "event.reply(__import__('os', None, None, ['path']))", ""),
    ("builtins-via-func-builtins", "def f():\n    pass\nevent.reply(f.__builtins__)", ""),
    ("class-dict-mappingproxy", "class A:\n    pass\nevent.reply(A.__dict__)", ""),
    ("object-new-on-event-type", "E = type(event)\nevent.reply(object.__new__(E))", ""),
    ("object-reduce-ex", "event.reply(object().__reduce_ex__(2))", ""),
    ("set-name-hook", "class D:\n    def __set_name__(self, o, n):\n        pass", ""),
    ("length-hint", "class D:\n    def __length_hint__(self):\n        return 1", ""),
    ("index-dunder", "class D:\n    def __index__(self):\n        return 1", ""),
    ("missing-dunder", "class D(dict):\n    def __missing__(self, k):\n        return 1", ""),
    ("del-dunder", "class D:\n    def __del__(self):\n        pass", ""),
    ("getattr-dunder", "class D:\n    def __getattr__(self, n):\n        pass", ""),
    ("format-dunder", "class D:\n    def __format__(self, s):\n        return ''", ""),
    ("mro-entries", "class D:\n    def __mro_entries__(self, b):\n        return ()", ""),
    ("class-dunder-assign-setattr", "class D:\n    pass\nD.__eq__ = len", ""),
    ("total-ordering-library-class", "functools.total_ordering(json.JSONDecodeError)",
     "import functools, json\n"),
    ("namespace-object-getattribute", "event.reply(object.__getattribute__(json, '_members'))",
     "import json\n"),
    ("type-of-scripttype-via-class", "class A:\n    pass\nM = type(A)", ""),
    ("type-of-namespace", "N = type(json)\nevent.reply(N('x', {'sys': 1}))", "import json\n"),
    ("namespace-subclass", "class N(type(json)):\n    pass", "import json\n"),
    ("event-subclass", "class E(type(event)):\n    pass", ""),
    ("decimal-getcontext", "event.reply(decimal.getcontext())", "import decimal\n"),
    ("random-module-os", "event.reply(random.Random().__module__)", "import random\n"),
    ("re-purge", "re.purge()", "import re\n"),
    ("re-template-flag", "re.compile('a', 1)", "import re\n"),
]


@pytest.mark.parametrize("body,prelude", [(b, p) for _, b, p in REACH], ids=[i for i, _, _ in REACH])
def test_trusted_objects_stay_out_of_reach(body: str, prelude: str) -> None:
    result = compile_script(block(body, prelude))
    if not result.ok:
        return  # refused at compile time (names starting with "_" and so on)
    assert result.script is not None
    out = run_endpoint(result.script, make_event())
    _assert_plain(out)
    if out["error"] is None:
        # Succeeding is fine only when what came back is harmless plain data
        # (e.g. str(datetime) or a translated string): no type, module, frame,
        # function or private name ever reaches the reply.
        text = out["body"].decode("utf-8", "replace")
        for marker in ("<module", "<frame", "<code", "<function", "<class", "builtins",
                       "mappingproxy", "_members", "__"):
            assert marker not in text, (marker, text)


def test_error_reporting_never_runs_script_methods() -> None:
    # The runtime renders exception arguments itself: a datetime subclass
    # whose isoformat() would spin is shown as "<D object>", not str()-ed.
    start = time.perf_counter()
    out, _ = _run(block('''
        class D(datetime.date):
            def isoformat(self):
                while True:
                    pass
        raise ValueError(D(2020, 1, 1))''', "import datetime\n"))
    assert time.perf_counter() - start < 5
    assert out["error"]["message"] == "ValueError: <D object>"


def test_key_error_and_exception_groups_with_script_objects() -> None:
    out, _ = _run(block('''
        class K:
            def __eq__(self, other):
                while True:
                    pass
        raise KeyError(K())'''))
    assert out["error"]["message"] == "KeyError: <K object>"


# ---------------------------------------------------------------------------
# State shared between invocations (regression: already isolated)
# ---------------------------------------------------------------------------

POISON_THEN_CHECK: list[tuple[str, str, str, bytes]] = [
    ("decimal-context-prec",
     block("c = decimal.Context(prec=2)\nevent.reply(str(c.divide(decimal.Decimal(1), 3)))",
           "import decimal\n"),
     block("event.reply(str(decimal.Decimal(1) / 3))", "import decimal\n"),
     b'"0.3333333333333333333333333333"'),
    ("random-seed",
     block("random.seed(1)\nevent.reply(1)", "import random\n"),
     block("random.seed(1)\na = random.random()\nevent.reply(a == random.Random(1).random())",
           "import random\n"),
     b"true"),
    ("template-class-attribute",
     block("string.Template.delimiter = '%'\nevent.reply(1)", "import string\n"),
     block("event.reply(string.Template('$a').substitute(a=1))", "import string\n"),
     b'"1"'),
    ("namedtuple-defaults",
     block("P = collections.namedtuple('P', 'a', defaults=[[]])\nP().a.append(1)\nevent.reply(1)",
           "import collections\n"),
     block("P = collections.namedtuple('P', 'a', defaults=[[]])\nevent.reply(P().a)",
           "import collections\n"),
     b"[]"),
    ("timezone-utc",
     block("datetime.timezone.utc.x = 1\nevent.reply(1)", "import datetime\n"),
     block("event.reply(str(datetime.timezone.utc))", "import datetime\n"),
     b'"UTC"'),
    ("uuid-namespace",
     block("uuid.NAMESPACE_DNS.int = 1\nevent.reply(1)", "import uuid\n"),
     block("event.reply(str(uuid.NAMESPACE_DNS))", "import uuid\n"),
     b'"6ba7b810-9dad-11d1-80b4-00c04fd430c8"'),
    ("time-tzname-tuple",
     block("time.tzname[0] = 'X'\nevent.reply(1)", "import time\n"),
     block("event.reply(time.tzname[0] != 'X')", "import time\n"),
     b"true"),
    ("re-pattern-groupindex",
     block("re.compile('(?P<a>x)').groupindex['b'] = 2\nevent.reply(1)", "import re\n"),
     block("event.reply(dict(re.compile('(?P<a>x)').groupindex))", "import re\n"),
     b'{"a":1}'),
    ("lru-cache-in-module-code",
     "import functools\n@functools.cache\ndef f(x):\n    return [x]\n" + block(
         "f(1).append(2)\nevent.reply(f(1))"),
     "import functools\n@functools.cache\ndef f(x):\n    return [x]\n" + block(
         "event.reply(f(1))"),
     b"[1]"),
    ("hashlib-constructor-cache",
     block("hashlib.new('blake2b').update(b'x')\nevent.reply(1)", "import hashlib\n"),
     block("event.reply(hashlib.new('blake2b').hexdigest()[:8])", "import hashlib\n"),
     b'"786a02f7"'),
]


@pytest.mark.parametrize("poison,check,expected", [(p, c, e) for _, p, c, e in POISON_THEN_CHECK],
                         ids=[i for i, _, _, _ in POISON_THEN_CHECK])
def test_state_does_not_cross_invocations(poison: str, check: str, expected: bytes) -> None:
    first, report = _run(poison)
    _assert_plain(first)
    assert not report.leaked
    second, _ = _run(check)
    assert second["error"] is None, second["error"]
    assert second["body"] == expected


# ---------------------------------------------------------------------------
# Limits (end to end through the pool: time and memory are the worker's)
# ---------------------------------------------------------------------------

LIMIT_ATTACKS: list[tuple[str, str, set[str]]] = [
    ("huge-int-power", "x = 10 ** 10 ** 8", {"script_timeout", "script_memory_exceeded"}),
    ("str-times-n", "x = 'x' * 10 ** 9", {"script_memory_exceeded"}),
    ("bytes-times-n", "x = bytes(10 ** 9)", {"script_memory_exceeded"}),
    ("bytearray-growth", "b = bytearray()\nwhile True:\n    b += b'x' * 65536",
     {"script_memory_exceeded"}),
    # Each element a fresh 1 KB string: 'x' * 1000 alone is folded into one
    # shared constant, and the list then grows by 8 bytes per append, which
    # under load can run into the time limit before the memory cap.
    ("list-growth-caught", "l = []\ntry:\n    while True:\n        l.append('x' * (1000 + len(l) % 2))\n"
                           "except MemoryError:\n    event.reply('survived')",
     {"script_memory_exceeded"}),
    ("re-backtracking", "import re\nre.match('(a+)+$', 'a' * 40 + 'b')", {"script_timeout"}),
    ("catch-everything-loop", "while True:\n    try:\n        pass\n    except BaseException:\n"
                              "        pass", {"script_timeout"}),
    ("deep-tuple-hash-c-stack", "t = ()\nfor i in range(1000000):\n    t = (t,)\nhash(t)",
     {"crash", "script_timeout", "script_memory_exceeded", "script_error"}),
    ("pow-modless", "x = pow(7, 10 ** 9)", {"script_timeout", "script_memory_exceeded"}),
    ("math-factorial", "import math\nx = math.factorial(10 ** 7)",
     {"script_timeout", "script_memory_exceeded"}),
]


@pytest.mark.timeout(120)
def test_limits_end_the_attack_and_the_pool_keeps_serving() -> None:
    async def scenario(pool: Pool) -> None:
        for name, body, kinds in LIMIT_ATTACKS:
            started = time.perf_counter()
            out = await pool.run(ref(block(body)), pool_event(), Limits(500, 8192))
            elapsed = time.perf_counter() - started
            assert out.error_kind in kinds, (name, out.error_kind, out.error_message)
            assert elapsed < 10, (name, elapsed)
            ok = await pool.run(ref(block("event.reply('alive')")), pool_event(),
                                Limits(1000, 8192))
            assert ok.body == b'"alive"', name

    run_with_pool(scenario, size=1)


REPLY_LIMITS: list[tuple[str, str, str]] = [
    ("output-cap", "for i in range(100000):\n    print('x' * 100)\nevent.reply(1)", "ok"),
    ("reply-shared-string", "s = 'x' * 500000\nevent.reply([s] * 10)", "invalid_reply"),
    ("reply-deep", "x = []\nfor i in range(100):\n    x = [x]\nevent.reply(x)", "invalid_reply"),
    ("reply-nan", "event.reply({'a': float('nan')})", "invalid_reply"),
    ("reply-int-key", "event.reply({1: 2})", "invalid_reply"),
    ("reply-huge-int", "event.reply(10 ** 5000)", "invalid_reply"),
    ("status-huge-int", "event.status(10 ** 4000)", "invalid_reply"),
    ("header-long-value", "event.header('X-A', 'x' * 100000)", "invalid_reply"),
    ("header-many", "for i in range(100):\n    event.header('X-%d' % i, '1')", "invalid_reply"),
    ("header-set-cookie", "event.header('Set-Cookie', 'sid=1')", "invalid_reply"),
    ("header-crlf", "event.header('X-A', 'a\\r\\nSet-Cookie: sid=1')", "invalid_reply"),
    ("content-type-crlf", "event.header('Content-Type', 'text/html\\r\\nX: 1')", "invalid_reply"),
    ("reply-lone-surrogate", "event.reply('\\ud800')", "invalid_reply"),
    ("long-error-message", "raise ValueError('x' * 100000)", "script_error"),
    ("long-compile-name", "x = 1\n" + "_" + "a" * 5000 + " = 1", "script_error"),
]


@pytest.mark.timeout(120)
def test_reply_limits_hold_end_to_end() -> None:
    async def scenario(pool: Pool) -> None:
        for name, body, kind in REPLY_LIMITS:
            out = await pool.run(ref(block(body)), pool_event(), Limits(2000, 65536))
            if kind == "ok":
                assert out.error_kind is None, (name, out.error_message)
                assert len(out.output.encode()) <= 16384 + 64
            else:
                assert out.error_kind == kind, (name, out.error_kind, out.error_message)
                assert out.error_message is not None and len(out.error_message) <= 1003
            assert len(out.body) <= 1048576

    run_with_pool(scenario, size=1)


# ---------------------------------------------------------------------------
# R4: a compromised worker's replies are checked again by the service
# ---------------------------------------------------------------------------

GOOD_RESULT: dict[str, Any] = {"replied": True, "status": 200, "headers": [["X-A", "1"]],
                               "body": b"{}", "contentType": "application/json", "output": "",
                               "error": None}


def _res(**changes: Any) -> dict[str, Any]:
    r = {**GOOD_RESULT, **changes.pop("r", {})}
    return {"t": "res", "id": 1, "r": r, "peak": 0, "over": False, "dur": 1.0, "exit": False,
            **changes}


def test_r4_the_good_reply_passes() -> None:
    assert protocol.check_reply(_res()) is not None


BAD_REPLIES: list[tuple[str, dict[str, Any]]] = [
    ("set-cookie", _res(r={"headers": [["Set-Cookie", "sid=attacker"]]})),
    ("set-cookie-case", _res(r={"headers": [["sEt-CoOkIe", "sid=attacker"]]})),
    ("content-length", _res(r={"headers": [["Content-Length", "0"]]})),
    ("transfer-encoding", _res(r={"headers": [["Transfer-Encoding", "chunked"]]})),
    ("x-request-id", _res(r={"headers": [["X-Request-Id", "forged"]]})),
    ("ratelimit", _res(r={"headers": [["RateLimit-Remaining", "999"]]})),
    ("hsts", _res(r={"headers": [["Strict-Transport-Security", "max-age=0"]]})),
    ("header-crlf", _res(r={"headers": [["X-A", "1\r\nSet-Cookie: a=b"]]})),
    ("header-name-space", _res(r={"headers": [["X A", "1"]]})),
    ("header-non-latin1", _res(r={"headers": [["X-A", "\u2603"]]})),
    ("header-too-long", _res(r={"headers": [["X-A", "x" * 9000]]})),
    ("too-many-headers", _res(r={"headers": [["X-%d" % i, "1"] for i in range(65)]})),
    ("content-type-in-headers", _res(r={"headers": [["Content-Type", "text/html"]]})),
    ("content-type-crlf", _res(r={"contentType": "text/html\r\nSet-Cookie: a=b"})),
    ("status-101", _res(r={"status": 101})),
    ("status-199", _res(r={"status": 199})),
    ("status-600", _res(r={"status": 600})),
    ("status-bool", _res(r={"status": True})),
    ("body-too-large", _res(r={"body": b"x" * (1048576 + 1)})),
    ("body-str", _res(r={"body": "x"})),
    ("output-too-large", _res(r={"output": "x" * 100000})),
    ("error-message-too-large", _res(r={"replied": False, "error": {
        "kind": "script_error", "message": "x" * 5000, "line": None, "traceback": None}})),
    ("error-kind-unknown", _res(r={"replied": False, "error": {
        "kind": "pwned", "message": "x", "line": None, "traceback": None}})),
    ("dur-nan", _res(dur=math.nan)),
    ("dur-inf", _res(dur=math.inf)),
    ("dur-negative", _res(dur=-1.0)),
    ("dur-int", _res(dur=1)),
    ("peak-negative", _res(peak=-1)),
    ("peak-huge", _res(peak=1 << 64)),
    ("peak-bool", _res(peak=True)),
    ("exit-int", _res(exit=1)),
    ("not-a-map", [1, 2]),  # type: ignore[list-item]
    ("unknown-type", {"t": "pwn", "id": 1}),
]


@pytest.mark.parametrize("msg", [m for _, m in BAD_REPLIES], ids=[i for i, _ in BAD_REPLIES])
def test_r4_malicious_worker_replies_are_refused(msg: Any) -> None:
    with pytest.raises(ProtocolError):
        protocol.check_reply(msg)


MALFORMED_FRAMES: list[tuple[str, bytes]] = [
    ("deep-nesting", b"\x91" * 200000 + b"\xc0"),
    ("non-str-key", msgpack.packb({1: 2})),
    ("tuple-key", b"\x81\x92\x01\x02\x03"),
    ("ext-type", msgpack.packb(msgpack.ExtType(5, b"x"))),
    ("truncated", msgpack.packb({"t": "res"})[:-1]),
    ("garbage", b"\xc1\xc1\xc1"),
    ("huge-declared-array", b"\xdd\xff\xff\xff\xff"),
    ("huge-declared-str", b"\xdb\xff\xff\xff\xff"),
]


@pytest.mark.parametrize("body", [b for _, b in MALFORMED_FRAMES],
                         ids=[i for i, _ in MALFORMED_FRAMES])
def test_r4_malformed_frames_never_crash_the_parent(body: bytes) -> None:
    try:
        msg = protocol.decode(body)
    except ProtocolError:
        return
    with pytest.raises(ProtocolError):
        protocol.check_reply(msg)


def test_r4_frame_reader_refuses_oversized_length_before_buffering() -> None:
    reader = protocol.FrameReader(protocol.MAX_REPLY_BYTES)
    with pytest.raises(ProtocolError):
        list(reader.feed((protocol.MAX_REPLY_BYTES + 1).to_bytes(4, "big") + b"x"))
    reader = protocol.FrameReader(protocol.MAX_REPLY_BYTES)
    assert list(reader.feed(b"\x00\x00")) == []  # half a header: waits, holds 2 bytes


def test_r4_forged_reply_from_a_compromised_worker_is_refused_end_to_end() -> None:
    # Unrestricted code in a hardened worker answers its own pending request
    # with a frame that sets a cookie on the dashboard's origin.
    code = '''
import os, msgpack
r = {"replied": True, "status": 200, "headers": [["Set-Cookie", "session=attacker"]],
     "body": b"{}", "contentType": "application/json", "output": "", "error": None}
def forge(job_id):
    body = msgpack.packb({"t": "res", "id": job_id, "r": r, "peak": 0, "over": False,
                          "dur": 1.0, "exit": False}, use_bin_type=True)
    os.write(3, len(body).to_bytes(4, "big") + body)
for guess in range(1, 50):
    forge(guess)
result = "sent"
'''

    async def scenario(pool: Pool) -> None:
        await pool._test_exec(code)
        for _ in range(200):
            if pool.worker_pids:
                break
            await asyncio.sleep(0.01)
        out = await pool.run(ref(block("event.reply(1)")), pool_event(), Limits(1000, 4096))
        assert out.body == b"1" and not any(n.lower() == "set-cookie" for n, _ in out.headers)

    run_with_pool(scenario, size=1, _unsafe_test_hooks=True)


def test_r4_a_frame_of_tiny_objects_costs_the_service_no_memory() -> None:
    # One byte of msgpack (an empty map) decodes to ~70 bytes of Python: a
    # worker taken over by its script made the service allocate ~300 MB and
    # stall its event loop for up to a second with one 4 MiB frame, and
    # padding a valid reply with a key nothing reads did it on every request
    # without the worker ever being replaced (security review, session 25).
    code = '''
import os
n = 4 * 1024 * 1024 - 20
body = b"\\x83\\xa1t\\xa3res\\xa2id\\x00\\xa3pad\\xdd" + n.to_bytes(4, "big") + b"\\x80" * n
view = memoryview(len(body).to_bytes(4, "big") + body)
while view:
    view = view[os.write(3, view):]
result = 1
'''

    async def scenario(pool: Pool) -> None:
        forger = pool.worker_pids[0]
        tracemalloc.start()
        try:
            await asyncio.wait_for(pool._test_exec(code), 30)   # answered as a crash
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 32 << 20, f"the service allocated {peak >> 20} MiB for one frame"
        out = await pool.run(ref(block("event.reply('fine')")), pool_event(),
                             Limits(1000, 4096), "another-guild")
        assert out.body == b'"fine"' and forger not in pool.worker_pids
        assert pool.counters["crashes"] >= 1

    run_with_pool(scenario, size=1, _unsafe_test_hooks=True)


# ---------------------------------------------------------------------------
# R5-R8: OS layer, unrestricted code in a real hardened worker
# ---------------------------------------------------------------------------

OS_PROBE = r'''
import ctypes, errno, fcntl, os, resource
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
res = {}
def ptr(b):
    return ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value
def sc(name, nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    res[name] = "allowed" if r >= 0 else ctypes.get_errno()
def attempt(name, fn):
    try:
        fn()
        res[name] = "allowed"
    except OSError as exc:
        res[name] = exc.errno
SIB = SIBLING
# files
sc("creat", 85, ptr(CREAT_PATH.encode()), 0o644)
sc("name_to_handle_at", 303, -100, ptr(b"/etc/hostname"), 0, 0, 0)
sc("open_by_handle_at", 304, -100, 0, 2)
sc("memfd_create", 319, ptr(b"x"), 0)
sc("utimensat", 280, -100, ptr(b"/tmp"), 0, 0)
sc("setxattr", 188, ptr(b"/tmp"), ptr(b"user.x"), ptr(b"1"), 1, 0)
# other processes (the sibling worker runs another guild's script)
attempt("prlimit_sibling", lambda: resource.prlimit(SIB, resource.RLIMIT_NOFILE))
attempt("prlimit_parent", lambda: resource.prlimit(os.getppid(), resource.RLIMIT_CPU, (0, 0)))
attempt("setpriority_sibling", lambda: os.setpriority(os.PRIO_PROCESS, SIB, 19))
attempt("setpriority_user", lambda: os.setpriority(os.PRIO_USER, os.getuid(), 19))
attempt("sched_setaffinity_sibling", lambda: os.sched_setaffinity(SIB, {0}))
attempt("sched_setscheduler_sibling",
        lambda: os.sched_setscheduler(SIB, os.SCHED_IDLE, os.sched_param(0)))
# its own scheduling policy: workers stay SCHED_BATCH (a waking one never preempts the service)
attempt("sched_setscheduler_self",
        lambda: os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0)))
sc("sched_setattr_self", 314, 0, 0, 0)
res["policy"] = os.sched_getscheduler(0)
sc("ioprio_set_user", 251, 3, os.getuid(), 0)
sc("migrate_pages", 256, SIB, 8, 0, 0)
sc("move_pages", 279, SIB, 0, 0, 0, 0, 0)
sc("tgkill_sibling", 234, SIB, SIB, 0)
sc("kill_minus1", 62, -1, 0)
sc("kill_parent", 62, os.getppid(), 0)
attempt("sibling_mem", lambda: open("/proc/%d/mem" % SIB, "rb").close())
attempt("sibling_environ", lambda: open("/proc/%d/environ" % SIB, "rb").read())
attempt("zygote_environ", lambda: open("/proc/%d/environ" % os.getppid(), "rb").read())
# terminal injection: EPERM from seccomp (ENOTTY would mean the call ran)
attempt("tiocsti", lambda: fcntl.ioctl(0, 0x5412, b"x"))
sc("tiocsti_high_bits", 16, 0, 0x100005412, ptr(b"x"))
sc("tioclinux", 16, 0, 0x541C, ptr(b"x"))
attempt("dev_tty", lambda: open("/dev/tty", "rb").close())
# namespaces, mounts and kernel interfaces
sc("clone_thread_newnet", 56, 0x00010000 | 0x00000800 | 0x00000100 | 0x40000000, 0, 0, 0, 0)
sc("clone_thread_newns", 56, 0x00010000 | 0x00000800 | 0x00000100 | 0x00020000, 0, 0, 0, 0)
sc("clone_process", 56, 17, 0, 0, 0, 0)
sc("clone3", 435, 0, 0)
sc("unshare_user", 272, 0x10000000)
sc("unshare_net", 272, 0x40000000)
sc("setns", 308, 0, 0)
sc("mount", 165, ptr(b"none"), ptr(b"/tmp"), ptr(b"tmpfs"), 0, 0)
sc("chroot", 161, ptr(b"/"))
sc("fsopen", 430, ptr(b"tmpfs"), 0)
sc("open_tree", 428, -100, ptr(b"/"), 0)
sc("userfaultfd", 323, 0)
sc("perf_event_open", 298, 0, 0, -1, -1, 0)
sc("bpf", 321, 0, 0, 0)
sc("keyctl", 250, 0, 0)
sc("add_key", 248, 0, 0, 0, 0, 0)
sc("personality", 135, 0x0040000)
sc("ptrace", 101, 16, SIB, 0, 0)
sc("process_vm_readv", 310, SIB, 0, 0, 0, 0, 0)
sc("process_vm_writev", 311, SIB, 0, 0, 0, 0, 0)
# calls the kernel would answer for a worker, each naming another process or
# the host (EFAULT, EBADF, EINVAL or 0 without the filter: never EPERM)
sc("capget", 125, 0, 0)                             # any pid's capabilities
sc("ustat", 136, 0, 0)                              # a disk's free space by device
sc("process_madvise", 440, -1, 0, 0, 0, 0)          # another process's memory
sc("kcmp", 312, os.getpid(), os.getpid(), 1, 0, 0)  # KCMP_VM; with a pid, a sibling's
sc("pidfd_open", 434, SIB, 0)
sc("execveat", 322, -100, ptr(b"/bin/true"), 0, 0, 0)
sc("io_uring_setup", 425, 1, 0)
sc("socket", 41, 2, 1, 0)
sc("fanotify_init", 300, 0, 0)
sc("syslog", 103, 3, 0, 0)
sc("statmount", 457, 0, 0, 0, 0)
sc("listmount", 458, 0, 0, 0, 0)
sc("acct", 163, 0)
sc("settimeofday", 164, 0, 0)
sc("openat2", 437, -100, ptr(b"/etc/hostname"), 0, 0)
attempt("openat_wronly", lambda: os.open(WRONLY_PATH, os.O_WRONLY | os.O_CREAT))
attempt("openat_tmpfile", lambda: os.open("/tmp", os.O_TMPFILE | os.O_RDWR))
# what must keep working: the worker's own limits, threads' self signals
attempt("setrlimit_self", lambda: resource.setrlimit(
    resource.RLIMIT_CPU, resource.getrlimit(resource.RLIMIT_CPU)))
attempt("read_own_status", lambda: open("/proc/self/status", "rb").read())
res["session_leader"] = os.getsid(0) == os.getpid()
res["dumpable"] = libc.prctl(3, 0, 0, 0, 0)
res["pid"] = os.getpid()
result = res
'''

ROOT = os.geteuid() == 0
DENIED = {errno.EPERM, errno.EACCES}


def _os_probe_code(sibling: int) -> tuple[str, list[str]]:
    """OS_PROBE for `sibling`, and the paths it tries to create: new ones on
    every run, so a file a broken filter let a worker (`nobody`) create
    cannot fail a later run on an unchanged tree."""
    tag = f"{os.getpid()}-{os.urandom(6).hex()}"
    paths = [f"/tmp/redteam-creat-probe-{tag}", f"/tmp/redteam-probe-{tag}"]
    code = (OS_PROBE.replace("SIBLING", str(sibling)).replace("CREAT_PATH", repr(paths[0]))
            .replace("WRONLY_PATH", repr(paths[1])))
    return code, paths


def _remove_left_behind(paths: list[str]) -> list[str]:
    """Which of `paths` exist; each is removed."""
    left = [p for p in paths if os.path.lexists(p)]
    for p in left:
        os.unlink(p)
    return left


@pytest.fixture(scope="module")
def os_probe() -> dict[str, Any]:
    async def scenario(pool: Pool) -> dict[str, Any]:
        pids = pool.worker_pids
        code, paths = _os_probe_code(pids[1])
        # The worker opens no file, its own /proc entries included: what they
        # show once it is hardened is read from here, before the probe runs.
        try:
            ok, value, outside = await exec_seen(pool, code)
        finally:
            left_behind = _remove_left_behind(paths)
        assert ok, value
        assert pids[1] in pool.worker_pids  # the sibling survived everything
        return {**value, "outside": outside, "left_behind": left_behind}

    return run_with_pool(scenario, size=2, _unsafe_test_hooks=True)  # type: ignore[no-any-return]


OS_DENIED = [
    # R5: file creation and metadata outside the open/openat flag rules
    "creat", "name_to_handle_at", "open_by_handle_at", "memfd_create", "utimensat", "setxattr",
    # R7: other processes of the same uid
    "prlimit_sibling", "prlimit_parent", "setpriority_sibling", "setpriority_user",
    "sched_setaffinity_sibling", "sched_setscheduler_sibling", "sched_setscheduler_self",
    "sched_setattr_self", "ioprio_set_user",
    "migrate_pages", "move_pages",
    # R8: terminal injection, also with garbage in the upper half of the request
    "tiocsti", "tiocsti_high_bits", "tioclinux",
    # R5: namespaces even together with CLONE_THREAD
    "clone_thread_newnet", "clone_thread_newns",
    # already denied before the review (regression)
    "tgkill_sibling", "kill_minus1", "kill_parent", "clone_process", "unshare_user",
    "unshare_net", "setns", "mount", "chroot", "fsopen", "open_tree", "userfaultfd",
    "perf_event_open", "bpf", "keyctl", "add_key", "personality", "ptrace",
    "process_vm_readv", "process_vm_writev", "pidfd_open", "execveat", "io_uring_setup",
    "socket", "fanotify_init", "syslog", "acct", "settimeofday", "openat_wronly",
    "statmount", "listmount",   # the host's mount table (review of session 16)
    "openat_tmpfile",
    # another process's or the host's state, found by mutation testing to have no test
    "capget", "ustat", "process_madvise", "kcmp",
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", OS_DENIED)
def test_os_layer_denies(os_probe: dict[str, Any], name: str) -> None:
    assert os_probe[name] in DENIED, (name, os_probe[name])


@pytest.fixture(scope="module")
def seccomp_probe() -> dict[str, Any]:
    """The same probe with Landlock and the empty root off: what only the
    seccomp filter (or the missing privilege) refuses."""
    async def scenario(pool: Pool) -> dict[str, Any]:
        pids = pool.worker_pids
        code, paths = _os_probe_code(pids[1])
        try:
            ok, value, _ = await exec_seen(pool, code)
        finally:
            _remove_left_behind(paths)   # (what a missing rule let it create: not kept)
        assert ok, value
        return value  # type: ignore[no-any-return]

    return run_with_pool(scenario, size=2, _unsafe_test_hooks=True,  # type: ignore[no-any-return]
                         landlock=False, empty_root=False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", OS_DENIED)
def test_the_seccomp_filter_itself_denies(seccomp_probe: dict[str, Any], name: str) -> None:
    # Outside review, session 17: 23 of these also passed with seccomp off,
    # Landlock's or the empty root's EACCES standing in for the filter's EPERM.
    assert seccomp_probe[name] == errno.EPERM, (name, seccomp_probe[name])


@pytest.mark.timeout(60)
def test_os_layer_details(os_probe: dict[str, Any]) -> None:
    assert os_probe["left_behind"] == []
    # clone3 and openat2 answer ENOSYS so libc falls back to inspectable calls
    assert os_probe["clone3"] == errno.ENOSYS and os_probe["openat2"] == errno.ENOSYS
    # other workers' and the zygote's memory and environment are closed (R7)
    for name in ("sibling_mem", "sibling_environ", "zygote_environ"):
        assert os_probe[name] in DENIED, (name, os_probe[name])
    outside = os_probe["outside"]
    # R8: no controlling terminal (own session); dumpable off (R7)
    assert os_probe["session_leader"] is True
    # (/dev/tty: ENXIO without a terminal, EACCES where Landlock opens nothing)
    assert outside["stat"][4] == b"0" and os_probe["dev_tty"] in (errno.ENXIO, errno.EACCES)
    assert os_probe["dumpable"] == 0
    status = outside["status"]
    assert status["Seccomp"] == "2" and status["NoNewPrivs"] == "1"
    assert os_probe["policy"] == os.SCHED_BATCH
    if ROOT:
        assert status["CapEff"] == "0000000000000000"
        # R6: no byte of the service's exec-time environment in the worker (the
        # fork server is exec'd with an empty one; a worker zeroes what it has)
        assert outside["environ_block"] is not None and not any(outside["environ_block"])
        assert outside["fds"] == [0, 1, 2, 3, 4]
        assert outside["fd_targets"] == [f"/proc/{os_probe['pid']}/statm"]
    # what the worker itself needs still works; its own /proc is closed too
    assert os_probe["setrlimit_self"] == "allowed"
    assert os_probe["read_own_status"] in DENIED


# ---------------------------------------------------------------------------
# R9: the service's memory does not reach workers (fresh zygote interpreter)
# ---------------------------------------------------------------------------

SERVICE_MEMORY_PROBE = r'''
import gc, sys
needle = "REVERSED_MARK"[::-1]  # never written forwards in the code we send
mine = globals()
found = []
frame = sys._getframe()
while frame is not None:
    scope = frame.f_locals
    for name, value in list(scope.items()) if scope is not mine else ():
        if value is not mine and needle in repr(value)[:10000]:
            found.append("frame %s.%s" % (frame.f_code.co_name, name))
    frame = frame.f_back
for name in list(sys.modules):
    if name.startswith(("tests", "service", "__main__")) and name != "__main__":
        found.append("module " + name)
for obj in gc.get_objects():
    if type(obj) is dict and obj is not mine and \
            any(type(v) is str and needle in v for v in obj.values()):
        found.append("dict")
        break
result = found
'''


@pytest.mark.timeout(60)
def test_r9_service_settings_and_frames_are_not_in_worker_memory() -> None:
    # What serve() holds when it starts the pool: settings with a password.
    settings = {"database_url": "postgresql://logic:" + SECRET + "@db/logic"}

    async def scenario(pool: Pool) -> Any:
        return await pool._test_exec(SERVICE_MEMORY_PROBE.replace("REVERSED_MARK", SECRET[::-1]))

    ok, found = run_with_pool(scenario, size=1, _unsafe_test_hooks=True)
    assert settings["database_url"].endswith("@db/logic")  # alive in this frame all along
    assert ok and found == [], found


FORGED_FRAMES: list[tuple[str, str]] = [
    ("second-ready", 'frame({"t": "ready", "pid": 1, "hard": {}, "notes": []})'),
    ("need-unknown-id", 'frame({"t": "need", "id": 987654})'),
    ("compiled-unknown-id", 'frame({"t": "compiled", "id": 987654})'),
    ("res-unknown-id", 'frame({"t": "res", "id": 987654, "r": {}, "peak": 0, "over": False, '
                       '"dur": 1.0, "exit": False})'),
    ("oversized-length", 'raw((64 << 20).to_bytes(4, "big") + b"x" * 1024)'),
    ("garbage", 'raw(b"\\x00\\x00\\x00\\x03\\xc1\\xc1\\xc1")'),
    ("deep-nesting", 'body = b"\\x91" * 100000 + b"\\xc0"\nraw(len(body).to_bytes(4, "big") + body)'),
    ("non-str-keys", 'body = msgpack.packb({1: 2})\nraw(len(body).to_bytes(4, "big") + body)'),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("forge", [f for _, f in FORGED_FRAMES], ids=[i for i, _ in FORGED_FRAMES])
def test_r4_forged_frames_retire_the_worker_and_the_pool_keeps_serving(forge: str) -> None:
    code = ("import os, msgpack\n"
            "def raw(data):\n    os.write(3, data)\n"
            "def frame(message):\n"
            "    body = msgpack.packb(message, use_bin_type=True)\n"
            "    raw(len(body).to_bytes(4, 'big') + body)\n" + forge + "\nresult = 1\n")

    async def scenario(pool: Pool) -> None:
        forger = pool.worker_pids[0]
        await pool._test_exec(code)
        for _ in range(300):
            if pool.worker_pids and forger not in pool.worker_pids:
                break
            await asyncio.sleep(0.01)
        assert forger not in pool.worker_pids
        out = await pool.run(ref(block("event.reply('fine')")), pool_event(), Limits(1000, 4096))
        assert out.body == b'"fine"'

    run_with_pool(scenario, size=1, _unsafe_test_hooks=True)


# ---------------------------------------------------------------------------
# R10: a compromised worker cannot extend its own deadline with "need"
# ---------------------------------------------------------------------------

def test_r10_need_is_honoured_once_per_request() -> None:
    import socket

    from sandbox.channel import RequestState, WorkerHandle

    pool = Pool(size=1)  # never started: only the message handling is driven
    loop = asyncio.new_event_loop()
    ours, theirs = socket.socketpair()
    try:
        pool._loop = loop
        w = WorkerHandle(0, 424242, ours.detach(), -1, cache_size=4, max_jobs=10, now=0.0)
        script = ref(block("event.reply(1)"))
        req = RequestState(loop.create_future(), "job", script, pool_event(), Limits(1000, 512))
        req.id = 7
        w.req = req
        w.known[(script.key, script.version)] = None  # the service thinks the worker has it
        pool._on_message(w, {"t": "need", "id": 7})  # legitimate: source sent with a budget
        assert req.ships_source and req.deadline > 0
        with pytest.raises(ProtocolError):  # asking again for what it was just sent
            pool._on_message(w, {"t": "need", "id": 7})
        pool._on_message(w, {"t": "compiled", "id": 7})
        deadline = req.deadline
        with pytest.raises(ProtocolError):  # after compiling: no second compile budget
            pool._on_message(w, {"t": "need", "id": 7})
        assert req.deadline == deadline
        w.sock.close()
    finally:
        theirs.close()
        loop.close()


# ---------------------------------------------------------------------------
# A worker sends nothing between jobs (review, session 30: an idle,
# compromised worker dribbling a 4 MiB frame a byte at a time kept ~55 % of
# the service's loop busy, unnoticed)
# ---------------------------------------------------------------------------

def _steal_fd(pid: int, fd: int) -> int:
    """A copy of another process's descriptor (pidfd_getfd, Linux 5.6+, root)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        stolen = libc.syscall(438, pidfd, fd, 0)   # SYS_pidfd_getfd on x86_64 and arm64
        if stolen < 0:
            raise OSError(ctypes.get_errno(), "pidfd_getfd")
        return int(stolen)
    finally:
        os.close(pidfd)


def test_bytes_from_an_idle_worker_retire_it() -> None:
    import platform
    if platform.machine() not in ("x86_64", "aarch64") or os.geteuid() != 0:
        pytest.skip("needs root and pidfd_getfd (x86_64/aarch64) to write as a worker would")

    async def scenario(pool: Pool) -> None:
        ok = await pool.run(ref(block("event.reply(1)")), pool_event(), Limits(1000, 4096), "A")
        assert ok.body == b"1"
        idle = pool.worker_pids
        pid = next(p for p in idle)
        try:
            channel = _steal_fd(pid, 3)   # the worker's end of its channel
        except OSError as err:
            pytest.skip(f"pidfd_getfd refused here: {err}")
        try:
            os.write(channel, (4 << 20).to_bytes(4, "big") + b"\x80")   # a frame begun, idle
        finally:
            os.close(channel)
        for _ in range(300):
            if pid not in pool.worker_pids:
                break
            await asyncio.sleep(0.01)
        assert pid not in pool.worker_pids
        again = await pool.run(ref(block("event.reply(2)")), pool_event(), Limits(1000, 4096), "A")
        assert again.body == b"2"

    run_with_pool(scenario, size=1)


def test_an_idle_worker_that_uses_cpu_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Review, session 30: a compromised worker raised its own RLIMIT_CPU soft
    # limit (allowed: the backstop moves it) and spun between jobs, outside
    # every budget (+67 % latency for another guild with two of them). A
    # worker cannot be made to spin here without taking one over, so its CPU
    # clock is what is stood in for: the real worker's reading plus a second
    # a look, which is what a spinning one shows housekeeping.
    from tests.sandbox.poolkit import stand_in_spin_and_growth
    spinning, _ = stand_in_spin_and_growth(monkeypatch)

    async def scenario(pool: Pool) -> None:
        ok = await pool.run(ref(block("event.reply(1)")), pool_event(), Limits(1000, 4096), "A")
        assert ok.body == b"1"
        quiet = await settled_workers(pool)    # a spare readied late is not a kill
        await asyncio.sleep(2.5)               # two rounds: idle workers that stay idle live
        assert set(pool.worker_pids) == quiet
        target = next(iter(pool._lru)).pid     # guild A's idle worker
        spinning.add(target)
        for _ in range(400):
            if target not in pool.worker_pids:
                break
            await asyncio.sleep(0.01)
        assert target not in pool.worker_pids and quiet - {target} <= set(pool.worker_pids)
        again = await pool.run(ref(block("event.reply(2)")), pool_event(), Limits(1000, 4096), "A")
        assert again.body == b"2"

    run_with_pool(scenario, size=1)


def test_job_ids_count_a_workers_own_jobs_only() -> None:
    # Review, session 30: ids came from one pool-wide counter, so a worker
    # (a compromised one reads its frames) learnt how many jobs other guilds
    # ran between two of its own. Each worker counts its own.
    from sandbox.channel import WorkerHandle
    seen: dict[int, list[int]] = {}
    real = WorkerHandle.job_frame

    def job_frame(self: WorkerHandle, req: Any, codes: Any = None) -> bytes:
        seen.setdefault(self.pid, []).append(req.id)
        return real(self, req, codes)

    async def scenario(pool: Pool) -> None:
        for i in range(6):
            for guild in ("A", "B"):
                out = await pool.run(ref(block(f"event.reply({i})"), key=f"logic_{guild}"),
                                     pool_event(), Limits(1000, 4096), guild)
                assert out.body == str(i).encode()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(WorkerHandle, "job_frame", job_frame)
        run_with_pool(scenario, size=2)
    assert seen and all(ids == list(range(1, len(ids) + 1)) for ids in seen.values()), seen
