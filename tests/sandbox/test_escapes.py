"""Published RestrictedPython escapes and classic Python sandbox escapes.

Each case is a real script run through ``compile_script`` + ``run_endpoint``.
It must fail (a compile error, or ``script_error``/``invalid_reply`` with the
expected message) and leak nothing: a secret planted in the trusted process
(an environment variable and a module global) never appears in the result,
and the result holds plain data only.
"""
from __future__ import annotations

import textwrap
from typing import Any

import pytest

from sandbox.compiler import compile_script
from sandbox.runtime import run_endpoint
from tests.sandbox.script_helpers import block, make_event

SECRET = "trusted-secret-8f3a1c"
TRUSTED_SECRET = SECRET  # a module global of trusted code
ENV_NAME = "LOGIC_ESCAPE_TEST_SECRET"

# (case id, script source, expected outcome, expected message prefix)
# outcome: "compile" (compile error), "script_error" or "invalid_reply".
CASES: list[tuple[str, str, str, str]] = [
    # --- CVE-2023-37271: generator frames -> f_back -> f_globals of trusted code
    ("cve-2023-37271-gi_frame", block("""\
        g = (x for x in [1])
        f = g.gi_frame.f_back.f_back
        event.reply(f.f_globals["TRUSTED_SECRET"])"""), "compile",
     '"gi_frame" is a restricted name'),
    ("cve-2023-37271-gi_code", block("g = (x for x in [1])\nevent.reply(g.gi_code)"),
     "compile", '"gi_code" is a restricted name'),
    ("cve-2023-37271-yieldfrom", block("""\
        def inner():
            yield 1
        def outer():
            yield from inner()
        g = outer()
        next(g)
        event.reply(g.gi_yieldfrom)"""), "compile", '"gi_yieldfrom" is a restricted name'),
    ("cve-2023-37271-f_back", block("def f():\n    pass\nx = f.f_back"), "compile",
     '"f_back" is a restricted name'),
    ("coroutine-cr_frame", block("x = event.cr_frame"), "compile",
     '"cr_frame" is a restricted name'),
    ("async-generator-ag_frame", block("x = event.ag_frame"), "compile",
     '"ag_frame" is a restricted name'),
    ("async-def", "async def f():\n    return 1\non endpoint(event):\n    event.reply(f().cr_frame)\n",
     "compile", "AsyncFunctionDef statements are not allowed."),
    # --- CVE-2023-41039 and CVE-2026-76825: str.format / string.Formatter field walking
    ("cve-2023-41039-format", block('event.reply("{0.__class__.__base__}".format(1))'),
     "script_error", "NotImplementedError: str.format() is not allowed"),
    ("cve-2023-41039-format_map", block('event.reply("{x.__class__}".format_map({"x": 1}))'),
     "script_error", "NotImplementedError: str.format_map() is not allowed"),
    ("cve-2023-41039-unbound", block('event.reply(str.format("{0.__class__}", 1))'),
     "script_error", "NotImplementedError: str.format() is not allowed"),
    ("cve-2023-41039-formatter", block(
        'event.reply(string.Formatter().get_field("0.__class__", [1], {}))', "import string\n"),
     "script_error", "AttributeError: module 'string' has no attribute 'Formatter'"),
    ("cve-2026-76825-formatter-import", block(
        'from string import Formatter\nevent.reply(Formatter().vformat("{0.__class__}", [1], {}))'),
     "script_error", "ImportError: cannot import name 'Formatter' from 'string'"),
    ("format-via-super", block("""\
        class S(str):
            pass
        s = S("{0.__globals__[sys].modules[os].environ}")
        event.reply(super(S, s).format(json.dumps))""", "import json\n"), "script_error",
     "NotImplementedError: str.format() is not allowed"),
    ("format_map-via-super", block("""\
        class S(str):
            pass
        event.reply(super(S, S("{x}")).format_map({"x": 1}))"""), "script_error",
     "NotImplementedError: str.format_map() is not allowed"),
    ("format-unbound-via-type", block('event.reply(type("").format("{0}", 1))'), "script_error",
     "NotImplementedError: str.format() is not allowed"),
    ("obj-via-super", block("""\
        try:
            json.nothing
        except AttributeError as exc:
            event.reply(super(AttributeError, exc).obj)""", "import json\n"), "script_error",
     'AttributeError: "obj" is a forbidden attribute of exceptions'),
    ("format-builtin-spec", block('event.reply(format("x", "{0.__class__}"))'),
     "script_error", "ValueError: Invalid format specifier"),
    # --- CVE-2024-47532: AttributeError.obj / NameError.obj
    ("cve-2024-47532-attributeerror-obj", block("""\
        try:
            string.nothing
        except AttributeError as exc:
            event.reply(exc.obj)""", "import string\n"), "script_error",
     'AttributeError: "obj" is a forbidden attribute of exceptions'),
    ("cve-2024-47532-nameerror-obj", block("""\
        try:
            undefined_name
        except NameError as exc:
            event.reply(exc.obj)"""), "script_error",
     'AttributeError: "obj" is a forbidden attribute of exceptions'),
    # --- CVE-2025-22153: try/except* type confusion
    ("cve-2025-22153-except-star", block("""\
        try:
            raise ValueError
        except* ValueError as eg:
            event.reply(eg.exceptions)"""), "compile",
     '"except*" (exception groups) is not allowed.'),
    ("cve-2025-22153-exceptiongroup", block('raise ExceptionGroup("x", [ValueError()])'),
     "script_error", "NameError: name 'ExceptionGroup' is not defined"),
    # --- CVE-2026-55830: guard hooks shadowed by positional-only parameters
    ("cve-2026-55830-posonly-write", block("""\
        def f(_write_, /):
            json.dumps = None
        f(lambda ob: ob)""", "import json\n"), "compile",
     '"_write_" is an invalid variable name'),
    ("cve-2026-55830-posonly-getattr", block("""\
        def f(_getattr_=getattr, /):
            return ().__class__"""), "compile", '"_getattr_" is an invalid variable name'),
    ("shadow-guard-lambda-default", block("f = lambda _getattr_=None: 0"), "compile",
     '"_getattr_" is an invalid variable name'),
    ("shadow-guard-kwonly", block("def f(*, _print_=None):\n    pass"), "compile",
     '"_print_" is an invalid variable name'),
    ("shadow-guard-varargs", block("def f(*_getiter_):\n    pass"), "compile",
     '"_getiter_" is an invalid variable name'),
    ("shadow-guard-walrus", block("x = (_getattr_ := 1)"), "compile",
     '"_getattr_" is an invalid variable name'),
    ("shadow-guard-comprehension", block("x = [1 for _getiter_ in [1]]"), "compile",
     '"_getiter_" is an invalid variable name'),
    ("shadow-guard-except-as", block("try:\n    pass\nexcept Exception as _write_:\n    pass"),
     "compile", '"_write_" is an invalid variable name'),
    ("shadow-guard-global", block("global _getattr_\n_getattr_ = None"), "compile",
     '"_getattr_" is an invalid variable name'),
    ("shadow-guard-class-name", block("class _write_:\n    pass"), "compile",
     '"_write_" is an invalid variable name'),
    ("shadow-guard-starred", block("*_getiter_, = [1]"), "compile",
     '"_getiter_" is an invalid variable name'),
    ("shadow-guard-import-as", block("import json as _getattr_"), "compile",
     '"_getattr_" is an invalid variable name'),
    # --- classic: the __subclasses__ walk, globals, code, builtins
    ("subclasses-walk", block("""\
        for c in ().__class__.__bases__[0].__subclasses__():
            if c.__name__ == "_wrap_close":
                event.reply(c.__init__.__globals__["environ"]["%s"])""" % ENV_NAME),
     "compile", '"__class__" is an invalid attribute name'),
    ("fullwidth-underscores", block("event.reply(event.＿＿class＿＿)"), "compile",
     "SyntaxError: invalid character '＿' (U+FF3F)"),
    ("nfkc-normalised-dunder", block("event.reply(event.__ｃｌａｓｓ__)"), "compile",
     '"__class__" is an invalid attribute name'),
    ("object-subclasses", block("event.reply(object.__subclasses__())"), "compile",
     '"__subclasses__" is an invalid attribute name'),
    ("function-globals", block("def f():\n    pass\nevent.reply(f.__globals__)"), "compile",
     '"__globals__" is an invalid attribute name'),
    ("trusted-function-globals", block('event.reply(json.dumps.__globals__["sys"])',
                                       "import json\n"), "compile",
     '"__globals__" is an invalid attribute name'),
    ("func_globals-runtime", block("event.reply(json.loads.func_globals)", "import json\n"),
     "script_error", 'AttributeError: "func_globals" is a forbidden attribute'),
    ("function-code", block("def f():\n    pass\nevent.reply(f.__code__.co_consts)"), "compile",
     '"__code__" is an invalid attribute name'),
    ("builtins-name", block('event.reply(__builtins__["open"])'), "compile",
     '"__builtins__" is an invalid variable name'),
    ("import-dunder", block('os = __import__("os")'), "compile",
     '"__import__" is an invalid variable name'),
    ("bound-method-self", block("event.reply(event.reply.__self__)"), "compile",
     '"__self__" is an invalid attribute name'),
    ("event-private-state", block("event.reply(event._state)"), "compile",
     '"_state" is an invalid attribute name'),
    ("im_self-runtime", block("event.reply(event.reply.im_self)"), "script_error",
     'AttributeError: "im_self" is a forbidden attribute'),
    ("mro", block("event.reply(int.mro()[-1])"), "script_error",
     'AttributeError: "mro" is a forbidden attribute'),
    # --- frames through tracebacks
    ("traceback-tb_frame", block("""\
        try:
            1 / 0
        except Exception as exc:
            event.reply(exc.__traceback__.tb_frame.f_globals)"""), "compile",
     '"__traceback__" is an invalid attribute name'),
    ("tb_frame-name", block("x = event.tb_frame"), "compile", '"tb_frame" is a restricted name'),
    ("exc-context", block("""\
        try:
            1 / 0
        except Exception as exc:
            event.reply(exc.__context__)"""), "compile", '"__context__" is an invalid attribute'),
    ("sys-exc_info", block("import sys\nevent.reply(sys.exc_info())"), "script_error",
     "ImportError: import of 'sys' is not allowed"),
    # --- imports by every route
    ("import-os", block("import os\nevent.reply(os.environ['%s'])" % ENV_NAME), "script_error",
     "ImportError: import of 'os' is not allowed"),
    ("importlib", block("import importlib\nimportlib.import_module('os')"), "script_error",
     "ImportError: import of 'importlib' is not allowed"),
    ("dotted-import", block("import json.decoder"), "script_error",
     "ImportError: import of 'json.decoder' is not allowed"),
    ("from-json-import-codecs", block("from json import codecs"), "script_error",
     "ImportError: cannot import name 'codecs' from 'json'"),
    ("from-json-import-decoder-sys-modules", block("from json import decoder"), "script_error",
     "ImportError: cannot import name 'decoder' from 'json'"),
    ("from-collections-import-abc", block("from collections import abc"), "script_error",
     "ImportError: cannot import name 'abc' from 'collections'"),
    ("json-decoder-scanstring-module", block("event.reply(json.decoder.scanstring.__module__)",
                                             "import json\n"), "compile",
     '"__module__" is an invalid attribute name'),
    ("json-codecs-builtins", block("event.reply(json.codecs.builtins)", "import json\n"),
     "script_error", "AttributeError: module 'json' has no attribute 'codecs'"),
    ("re-enum-sys", block("event.reply(re.enum.sys.modules)", "import re\n"), "script_error",
     "AttributeError: module 're' has no attribute 'enum'"),
    ("random-os", block("event.reply(random.os.environ)", "import random\n"), "script_error",
     "AttributeError: module 'random' has no attribute 'os'"),
    ("relative-import", block("from . import runtime"), "script_error",
     "ImportError: relative imports are not allowed"),
    ("pickle", block("import pickle"), "script_error",
     "ImportError: import of 'pickle' is not allowed"),
    ("ctypes", block("import ctypes"), "script_error",
     "ImportError: import of 'ctypes' is not allowed"),
    # --- making classes with arbitrary dunders
    ("type-three-args", block("""\
        C = type("C", (), {"__str__": lambda self: "x"})
        event.reply(C())"""), "script_error",
     "TypeError: type() takes exactly one argument here"),
    ("type-of-type", block('T = type(type(1))\nC = T("C", (), {})'), "script_error",
     "TypeError: type() of a class is not available"),
    ("metaclass-keyword", block("class M(type):\n    pass\nclass C(metaclass=M):\n    pass"),
     "compile", 'The keyword argument "metaclass" is not allowed.'),
    ("init_subclass", block("class C:\n    def __init_subclass__(cls):\n        pass"),
     "compile", '"__init_subclass__" is an invalid variable name'),
    ("class_getitem", block("class C:\n    def __class_getitem__(cls, i):\n        pass"),
     "compile", '"__class_getitem__" is an invalid variable name'),
    ("dunder-str-method", block("class C:\n    def __str__(self):\n        return 'x'"),
     "compile", '"__str__" is an invalid variable name'),
    ("dunder-hash-assign", block("class C:\n    __hash__ = None"), "compile",
     '"__hash__" is an invalid variable name'),
    ("reduce", block("event.reply(event.__reduce_ex__(2))"), "compile",
     '"__reduce_ex__" is an invalid attribute name'),
    ("super-subclasses", block("event.reply(super(type, int).__subclasses__())"), "compile",
     '"__subclasses__" is an invalid attribute name'),
    ("match-class-pattern", block("match event:\n    case object(__class__=c):\n        pass"),
     "compile", "Match statements are not allowed."),
    # --- objects whose methods would run in trusted code
    ("eq-object-as-status", block("""\
        class Sneaky:
            def __eq__(self, other):
                return True
        event.status(Sneaky())"""), "invalid_reply", "status must be an int, not Sneaky"),
    ("int-subclass-status", block("class I(int):\n    pass\nevent.status(I(200))"),
     "invalid_reply", "status must be an int, not I"),
    ("bool-status", block("event.status(True)"), "invalid_reply",
     "status must be an int, not bool"),
    ("str-subclass-header", block('class S(str):\n    pass\nevent.header(S("X-A"), "1")'),
     "invalid_reply", "header name and value must be str"),
    ("str-subclass-dict-key", block('class S(str):\n    pass\nevent.reply({S("k"): 1})'),
     "invalid_reply", "reply dict keys must be str, not S"),
    ("dict-subclass-reply", block("class D(dict):\n    pass\nevent.reply(D())"),
     "invalid_reply", "reply value of type D cannot be sent as JSON"),
    ("print-to-script-file", block('class F:\n    def write(self, s):\n        pass\n'
                                   'print("x", file=F())'), "script_error",
     "TypeError: print(file=...) is not supported"),
    # --- reflective builtins
    ("getattr", block('event.reply(getattr(event, "_state"))'), "script_error",
     "NameError: name 'getattr' is not defined"),
    ("vars", block("event.reply(vars(event))"), "script_error",
     "NameError: name 'vars' is not defined"),
    ("dir", block("event.reply(dir())"), "script_error", "NameError: name 'dir' is not defined"),
    ("globals", block('event.reply(globals()["__builtins__"])'), "script_error",
     "NameError: name 'globals' is not defined"),
    ("compile-builtin", block('compile("1", "x", "exec")'), "script_error",
     "NameError: name 'compile' is not defined"),
    ("open", block('event.reply(open("/etc/passwd").read())'), "script_error",
     "NameError: name 'open' is not defined"),
    ("decorator-eval", block("@eval\ndef f():\n    pass"), "script_error",
     "NameError: name 'eval' is not defined"),
    ("exec-call", block('exec("import os")'), "compile", "Exec calls are not allowed."),
    # --- shared state and dangerous module members
    ("poison-json-dumps", block("json.dumps = len", "import json\n"), "script_error",
     "TypeError: cannot assign to attributes or items of ModuleNamespace objects"),
    ("delete-module-member", block("del json.dumps", "import json\n"), "script_error",
     "TypeError: cannot assign to attributes or items of ModuleNamespace objects"),
    ("for-target-attribute-write", block("for json.dumps in [len]:\n    pass", "import json\n"),
     "script_error",
     "TypeError: cannot assign to attributes or items of ModuleNamespace objects"),
    ("unpack-target-attribute-write", block("json.loads, x = len, 1", "import json\n"),
     "script_error",
     "TypeError: cannot assign to attributes or items of ModuleNamespace objects"),
    ("super-write", block("class S(str):\n    pass\nsuper(S, S('x')).upper = len"),
     "script_error", "TypeError: cannot assign to attributes or items of super objects"),
    ("type-decorator-makes-function", block('@type\ndef f():\n    pass\nf(None, {})'),
     "script_error", "TypeError: function() argument 'code' must be code, not None"),
    ("future-import", "from __future__ import annotations\n" + block("event.reply(1)"),
     "script_error", "ImportError: import of '__future__' is not allowed"),
    ("poison-event-class", block("type(event).reply = len"), "script_error",
     "TypeError: cannot assign to attributes or items of type objects"),
    ("functools-update-wrapper", block("functools.update_wrapper(len, len)",
                                       "import functools\n"), "script_error",
     "AttributeError: module 'functools' has no attribute 'update_wrapper'"),
    ("decimal-default-context", block("decimal.DefaultContext.prec = 1", "import decimal\n"),
     "script_error", "AttributeError: module 'decimal' has no attribute 'DefaultContext'"),
    ("uuid-getnode-mac", block("event.reply(uuid.getnode())", "import uuid\n"), "script_error",
     "AttributeError: module 'uuid' has no attribute 'getnode'"),
    ("time-sleep", block("time.sleep(100)", "import time\n"), "script_error",
     "AttributeError: module 'time' has no attribute 'sleep'"),
    ("re-debug-int", block('re.compile("a", 128)', "import re\n"), "script_error",
     "ValueError: unsupported re flag"),
    ("namedtuple-field-injection", block(
        'collections.namedtuple("P", ["x", "y=__import__(\'os\')"])', "import collections\n"),
     "script_error", "ValueError: Type names and field names must be valid identifiers"),
    ("template-attribute-placeholder", block(
        'event.reply(string.Template("${a.__class__}").substitute(a=1))', "import string\n"),
     "script_error", "ValueError: Invalid placeholder in string"),
    ("hashlib-shared-set", block('hashlib.algorithms_available.add("x")', "import hashlib\n"),
     "script_error", "AttributeError: 'frozenset' object has no attribute 'add'"),
    ("recursion", block("def f():\n    return f()\nf()"), "script_error",
     "RecursionError: maximum recursion depth exceeded"),
]

PLAIN_TYPES = (str, bytes, int, float, bool, type(None))


def _plain_only(value: Any) -> bool:
    if type(value) is dict:
        return all(type(k) is str and _plain_only(v) for k, v in value.items())
    if type(value) is list:
        return all(_plain_only(v) for v in value)
    return type(value) in PLAIN_TYPES


def test_there_are_at_least_40_cases() -> None:
    assert len(CASES) >= 40
    assert len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize(("source", "outcome", "message"),
                         [pytest.param(src, out, msg, id=name) for name, src, out, msg in CASES])
def test_escape_is_blocked(source: str, outcome: str, message: str,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_NAME, SECRET)
    compiled = compile_script(textwrap.dedent(source))
    if outcome == "compile":
        assert not compiled.ok
        assert any(e.message.startswith(message) for e in compiled.errors), compiled.errors
        return
    assert compiled.ok, compiled.errors
    assert compiled.script is not None
    result = run_endpoint(compiled.script, make_event())
    assert _plain_only(result)
    assert result["error"] is not None, result
    assert result["error"]["kind"] == outcome, result["error"]
    assert result["error"]["message"].startswith(message), result["error"]
    assert result["replied"] is False
    flat = repr(result)
    assert SECRET not in flat
    assert "sandbox/" not in result["error"]["message"]
    traceback = result["error"]["traceback"] or ""
    assert all(line.startswith('  File "<script>"') for line in traceback.splitlines()
               if line.startswith("  File "))


def test_the_leak_check_would_see_a_leaked_secret() -> None:
    # positive control: if a script did obtain the secret, repr(result) shows it
    compiled = compile_script(block("event.reply({'leak': event.body['s']})"))
    assert compiled.script is not None
    result = run_endpoint(compiled.script, make_event(body={"s": SECRET}))
    assert SECRET in repr(result)
