"""Imports: the allowed modules as curated namespaces, and every other route refused."""
from __future__ import annotations

import builtins
import collections
import sys
import types
from typing import Any

import pytest

from sandbox.guards import DENIED_ATTRIBUTES
from sandbox.modules import (ALLOWED_MODULES, STATIC_NAMESPACES, ModuleNamespace,
                             make_importer, make_random_namespace)
from tests.sandbox.script_helpers import error_kind, error_message, run_block


def reply_of(body: str, prelude: str = "") -> bytes:
    out = run_block(body, prelude)
    assert out["error"] is None, out["error"]
    value: bytes = out["body"]
    return value


def test_allowed_module_list_is_the_designs() -> None:
    assert ALLOWED_MODULES == {
        "json", "math", "re", "random", "datetime", "time", "hashlib", "hmac", "base64",
        "string", "itertools", "functools", "collections", "statistics", "decimal", "uuid"}


@pytest.mark.parametrize(("prelude", "expr", "expected"), [
    ("import json", 'json.loads(json.dumps({"a": [1, 2]}))["a"]', b"[1,2]"),
    ("import math", "math.floor(math.sqrt(17)) + math.gcd(12, 18)", b"10"),
    ("import re", 're.sub(r"\\d+", "#", "a1b22") + re.compile("B", re.I).search("abc").group()',
     b'"a#b#b"'),
    ("import random", "0 <= random.randint(1, 6) - 1 < 6", b"true"),
    ("import datetime",
     "(datetime.datetime(2026, 1, 2, tzinfo=datetime.timezone.utc)"
     " + datetime.timedelta(days=1)).isoformat()", b'"2026-01-03T00:00:00+00:00"'),
    ("import time", "time.time() > 1.7e9 and time.monotonic() > 0", b"true"),
    ("import hashlib", 'hashlib.sha256(b"abc").hexdigest()[:8]', b'"ba7816bf"'),
    ("import hmac, hashlib", 'hmac.new(b"k", b"m", "sha256").hexdigest()[:8]', b'"b60090e3"'),
    ("import hmac", 'hmac.compare_digest("a", "a")', b"true"),
    ("import base64", 'base64.b64encode(b"hi").decode()', b'"aGk="'),
    ("import string", 'string.Template("$who!").substitute(who="you") + string.digits[:3]',
     b'"you!012"'),
    ("import itertools", "list(itertools.islice(itertools.count(5), 3))", b"[5,6,7]"),
    ("import functools", "functools.reduce(lambda a, b: a * b, [1, 2, 3, 4])", b"24"),
    ("import collections",
     'collections.Counter("abca").most_common(1)[0][0] + str(collections.deque([1], 2)[0])',
     b'"a1"'),
    ("import statistics", "statistics.median([3, 1, 2])", b"2"),
    ("import decimal", 'str(decimal.Decimal("1.10") + decimal.Decimal("2.2"))', b'"3.30"'),
    ("import uuid", "uuid.uuid4().version", b"4"),
    ("import uuid", 'str(uuid.uuid5(uuid.NAMESPACE_DNS, "example.com"))',
     b'"cfbff0d1-9375-5685-968c-48ce8b15ae17"'),
    ("from json import dumps as d", "d([1])", b'"[1]"'),
    ("from collections import namedtuple",
     'namedtuple("P", "x y")(1, 2).y', b"2"),
])
def test_allowed_modules_work(prelude: str, expr: str, expected: bytes) -> None:
    assert reply_of(f"event.reply({expr})", prelude + "\n") == expected


@pytest.mark.parametrize(("statement", "message"), [
    ("import os", "ImportError: import of 'os' is not allowed"),
    ("import sys", "ImportError: import of 'sys' is not allowed"),
    ("import importlib", "ImportError: import of 'importlib' is not allowed"),
    ("import io", "ImportError: import of 'io' is not allowed"),
    ("import ctypes", "ImportError: import of 'ctypes' is not allowed"),
    ("import subprocess", "ImportError: import of 'subprocess' is not allowed"),
    ("import json.decoder", "ImportError: import of 'json.decoder' is not allowed"),
    ("import os.path", "ImportError: import of 'os.path' is not allowed"),
    ("from json import decoder", "ImportError: cannot import name 'decoder' from 'json'"),
    ("from json import codecs", "ImportError: cannot import name 'codecs' from 'json'"),
    ("from collections import abc", "ImportError: cannot import name 'abc' from 'collections'"),
    ("from re import enum", "ImportError: cannot import name 'enum' from 're'"),
    ("from random import os", "ImportError: cannot import name 'os' from 'random'"),
    ("from string import Formatter",
     "ImportError: cannot import name 'Formatter' from 'string'"),
    ("from time import sleep", "ImportError: cannot import name 'sleep' from 'time'"),
    ("from . import json", "ImportError: relative imports are not allowed"),
    ("from .json import dumps", "ImportError: relative imports are not allowed"),
])
def test_refused_imports(statement: str, message: str) -> None:
    out = run_block(statement)
    assert error_kind(out) == "script_error"
    assert error_message(out) == message


@pytest.mark.parametrize(("module", "name"), [
    ("time", "sleep"), ("time", "tzset"), ("string", "Formatter"), ("functools", "wraps"),
    ("functools", "update_wrapper"), ("decimal", "setcontext"), ("decimal", "DefaultContext"),
    ("uuid", "uuid1"), ("uuid", "getnode"), ("decimal", "getcontext"), ("re", "DEBUG"), ("re", "purge"),
    ("json", "decoder"), ("json", "codecs"), ("json", "JSONEncoder"), ("random", "SystemRandom_"),
    ("hashlib", "file_digest"), ("collections", "abc"),
])
def test_names_that_do_not_exist(module: str, name: str) -> None:
    out = run_block(f"x = {module}.{name}", f"import {module}\n")
    assert error_message(out) == f"AttributeError: module '{module}' has no attribute '{name}'"


def test_namespaces_have_no_private_members_and_no_modules() -> None:
    for label, ns in STATIC_NAMESPACES.items():
        members = object.__getattribute__(ns, "_members")
        for name, value in members.items():
            assert not name.startswith("_"), (label, name)
            assert not isinstance(value, types.ModuleType), (label, name)


def test_re_debug_flag_is_refused_even_as_an_integer() -> None:
    out = run_block('re.compile("a", 128)', "import re\n")
    assert error_message(out) == ("ValueError: unsupported re flag (re.DEBUG and re.LOCALE "
                                  "are not available)")


def test_total_ordering_only_for_script_classes() -> None:
    assert reply_of("""\
        @functools.total_ordering
        class V:
            def __init__(self, v):
                self.v = v
            def __eq__(self, o):
                return self.v == o.v
            def __lt__(self, o):
                return self.v < o.v
        event.reply(V(2) >= V(1))
        """, "import functools\n") == b"true"
    out = run_block("functools.total_ordering(collections.Counter)",
                    "import functools, collections\n")
    assert error_message(out) == ("TypeError: total_ordering() only applies to classes "
                                  "defined by the script")


def test_random_state_is_per_invocation() -> None:
    seeded = reply_of("random.seed(1)\nevent.reply(random.random())", "import random\n")
    again = reply_of("random.seed(1)\nevent.reply(random.random())", "import random\n")
    assert seeded == again  # seeding works within an invocation
    follow = {reply_of("event.reply(random.random())", "import random\n") for _ in range(3)}
    assert seeded not in follow and len(follow) == 3


def test_random_is_the_same_generator_within_an_invocation() -> None:
    assert reply_of("""\
        import random as r2
        random.seed(7)
        a = r2.random()
        random.seed(7)
        event.reply(a == random.random())
        """, "import random\n") == b"true"


def test_decimal_context_is_reset_for_every_invocation() -> None:
    import decimal
    leftover = decimal.Context(prec=5)
    decimal.setcontext(leftover)  # as if something had changed the thread context
    try:
        out = reply_of("event.reply(str(decimal.Decimal(1) / decimal.Decimal(7)))",
                       "import decimal\n")
    finally:
        decimal.setcontext(decimal.Context())
    assert out == b'"0.1428571428571428571428571429"'


def test_decimal_thread_context_is_not_exposed() -> None:
    for name in ("getcontext", "setcontext", "localcontext", "DefaultContext"):
        out = run_block(f"x = decimal.{name}", "import decimal\n")
        assert error_message(out) == f"AttributeError: module 'decimal' has no attribute '{name}'"


def test_own_decimal_contexts_work_and_are_read_only() -> None:
    assert reply_of("""\
        ctx = decimal.Context(prec=5, rounding=decimal.ROUND_DOWN)
        event.reply(str(ctx.divide(decimal.Decimal(2), decimal.Decimal(3))))
        """, "import decimal\n") == b'"0.66666"'
    out = run_block("decimal.Context().prec = 2", "import decimal\n")
    assert error_message(out) == ("TypeError: cannot assign to attributes or items of "
                                  "Context objects")


MUTABLE = (dict, list, set, bytearray, collections.OrderedDict, collections.deque,
           collections.defaultdict)


def _walk(root: Any, depth: int, seen: set[int], found: list[str], path: str) -> None:
    if depth == 0 or id(root) in seen:
        return
    seen.add(id(root))
    if isinstance(root, MUTABLE):
        found.append(f"{path}: shared {type(root).__name__}")
    for name in dir(root):
        if name.startswith("_") or name in DENIED_ATTRIBUTES:
            continue
        if name in ("format", "format_map") and (isinstance(root, str) or root is str):
            continue
        try:
            value = getattr(root, name)
        except Exception:  # noqa: BLE001 - properties may refuse on classes
            continue
        where = f"{path}.{name}"
        if isinstance(value, (types.ModuleType, types.FrameType, types.CodeType,
                              types.TracebackType)) or value is builtins.__dict__ or \
                value is sys.modules:
            found.append(f"{where}: {type(value).__name__}")
        if isinstance(value, MUTABLE) and getattr(root, name) is not value:
            continue  # a fresh container per access (a property), not shared state
        _walk(value, depth - 1, seen, found, where)


def test_no_attribute_path_leads_to_modules_frames_code_or_shared_containers() -> None:
    found: list[str] = []
    seen: set[int] = set()
    for label, ns in STATIC_NAMESPACES.items():
        members = object.__getattribute__(ns, "_members")
        for name, value in members.items():
            _walk(value, 4, seen, found, f"{label}.{name}")
    members = object.__getattribute__(make_random_namespace(), "_members")
    for name, value in members.items():
        _walk(value, 4, seen, found, f"random.{name}")
    assert found == []


def test_namespace_objects_are_read_only_even_for_trusted_setattr() -> None:
    ns = STATIC_NAMESPACES["json"]
    with pytest.raises(AttributeError):
        ns.dumps = None
    with pytest.raises(TypeError):
        type("Sub", (ModuleNamespace,), {})


def test_strptime_and_datetime_methods_that_import_from_c_work() -> None:
    assert reply_of("""\
        d = datetime.datetime(2026, 1, 2, 3, 4, 5)
        event.reply([
            time.strptime("2026", "%Y").tm_year,
            datetime.datetime.strptime("2026-01-02", "%Y-%m-%d").day,
            d.timetuple().tm_mday,
            d.strftime("%Y/%m/%d"),
        ])
        """, "import datetime, time\n") == b'[2026,2,2,"2026/01/02"]'


def test_c_level_import_path_serves_nothing_to_scripts() -> None:
    importer = make_importer()
    # what C's PyImport_Import() sends: a list fromlist; it then reads sys.modules itself
    assert importer("_strptime", {}, {}, [], 0) is None
    assert importer("time", {}, {}, ["__doc__"], 0) is None
    # the same names through an import statement (tuple/None fromlist) are refused
    with pytest.raises(ImportError, match="import of '_strptime' is not allowed"):
        importer("_strptime", {}, {}, None, 0)
    with pytest.raises(ImportError, match="import of 'os' is not allowed"):
        importer("os", {}, {}, [], 0)
    assert isinstance(importer("time", {}, {}, None, 0), ModuleNamespace)


def _sample_instances() -> dict[str, Any]:
    """Objects scripts typically make from the exposed modules."""
    import datetime
    import decimal
    import functools
    import hashlib
    import hmac
    import itertools
    import re
    import statistics
    import string
    import time
    import uuid

    def script_like(x: int) -> int:
        return x

    pattern = re.compile("(?P<a>x)")
    return {
        "pattern": pattern, "match": pattern.match("x"), "scanner": getattr(pattern, "scanner")("x"),
        "datetime": datetime.datetime.now(datetime.timezone.utc),
        "timedelta": datetime.timedelta(1), "sha256": hashlib.sha256(),
        "hmac": hmac.new(b"k", b"m", "sha256"), "counter": collections.Counter("ab"),
        "context": decimal.Context(), "decimal": decimal.Decimal(1),
        "normaldist": statistics.NormalDist(), "uuid": uuid.uuid4(),
        "template": string.Template("$a"), "partial": functools.partial(len),
        "lru": functools.lru_cache(script_like), "count": itertools.count(),
        "struct_time": time.gmtime(0), "namedtuple": collections.namedtuple("P", "x")("v"),
        "random": make_random_namespace(), "deque": collections.deque([1]),
        "json_error": _json_error(),
    }


def _json_error() -> Exception:
    import json
    try:
        json.loads("{")
    except json.JSONDecodeError as exc:
        return exc
    raise AssertionError("unreachable")


def test_no_attribute_path_from_typical_instances_leads_anywhere_dangerous() -> None:
    found: list[str] = []
    seen: set[int] = set()
    for label, value in _sample_instances().items():
        # the instances themselves are the script's own (fresh) objects
        for name in dir(value):
            if name.startswith("_") or name in DENIED_ATTRIBUTES or name in ("format",
                                                                             "format_map"):
                continue
            try:
                attr = getattr(value, name)
            except Exception:  # noqa: BLE001
                continue
            if isinstance(attr, MUTABLE):
                continue  # the instance's own container (partial.keywords), not shared
            _walk(attr, 3, seen, found, f"{label}.{name}")
    assert found == []
