"""The modules a script may import, as curated read-only namespaces.

A script never sees a real module object: ``import json`` binds a
:class:`ModuleNamespace` holding only the names listed here. Real modules
would lead, through plain attribute chains, to everything else in the
process (``json.decoder.re.enum.sys.modules["os"]``), so each exposed name
was chosen one by one; see docs/security.md for the reasoning per module.

Namespaces are built once per process and are immutable, except ``random``,
whose functions are bound to a fresh ``random.Random()`` per invocation so no
generator state crosses invocations (and importing ``statistics`` re-seeds
the module-global generator its ``NormalDist.samples`` uses). ``decimal``'s thread context is reset by
the runtime before each invocation.
"""
from __future__ import annotations

import base64
import collections
import datetime
import decimal
import functools
import hashlib
import hmac
import importlib
import itertools
import json
import math
import os
import random
import statistics
import string
import sys
import time
import types
import uuid
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from sandbox import cpython_fixes, dict_tables, resets, safe_iterators
from sandbox.guards import ScriptType
from sandbox.restricted_re import RE_MEMBERS, Template, exact

# time.strptime and datetime.strptime import _strptime on first use; import
# it now so no import runs inside an invocation (under its memory cap and the
# worker's seccomp filter).
importlib.import_module("_strptime")


class ModuleNamespace:
    """A read-only bag of names standing in for a module.

    It has no public attributes of its own (so ``from json import decoder``
    cannot find one) and no ``__name__``: CPython's ``from x import y``
    fallback looks ``f"{x.__name__}.{y}"`` up in ``sys.modules``, which would
    otherwise hand out real submodules such as ``json.decoder``.
    """

    __slots__ = ("_label", "_members")

    def __init__(self, label: str, members: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_label", label)
        object.__setattr__(self, "_members", types.MappingProxyType(dict(members)))

    def __init_subclass__(cls, **kwargs: Any) -> NoReturn:
        raise TypeError("module namespaces cannot be subclassed")

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_"):
            try:
                return self._members[name]
            except KeyError:
                pass
        raise AttributeError(f"module {self._label!r} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise AttributeError(f"module {self._label!r} is read-only")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"module {self._label!r} is read-only")

    def __repr__(self) -> str:
        return f"<module {self._label!r}>"

    def __dir__(self) -> list[str]:
        return sorted(self._members)


def namespace_has(ns: ModuleNamespace, name: str) -> bool:
    """Whether ``name`` is an exposed member of ``ns`` (trusted helper)."""
    members: Mapping[str, Any] = object.__getattribute__(ns, "_members")
    return name in members


def namespace_members(ns: ModuleNamespace) -> list[Any]:
    """The exposed values of ``ns`` (trusted helper)."""
    members: Mapping[str, Any] = object.__getattribute__(ns, "_members")
    return list(members.values())


def _public(module: types.ModuleType, names: list[str]) -> dict[str, Any]:
    return {name: getattr(module, name) for name in names}


# --- functools: update_wrapper/wraps are generic getattr/setattr primitives
# (their `assigned` tuple names arbitrary attributes), so they are left out;
# total_ordering writes dunders onto its argument, so only script classes.
def _total_ordering(cls: Any) -> Any:
    if not isinstance(cls, ScriptType):
        raise TypeError("total_ordering() only applies to classes defined by the script")
    return functools.total_ordering(cls)


_FUNCTOOLS = {
    "reduce": functools.reduce, "partial": functools.partial,
    "cmp_to_key": functools.cmp_to_key, "lru_cache": dict_tables.lru_cache,
    "cache": dict_tables.cache, "total_ordering": _total_ordering,
}

_MATH = {name: getattr(math, name) for name in dir(math) if not name.startswith("_")}

_ITERTOOLS = {name: getattr(itertools, name) for name in dir(itertools) if not name.startswith("_")}
# CPython 3.11's groupby compares keys it holds no reference to: a key whose
# __eq__ advances the groupby made it use freed memory (sandbox/cpython_fixes.py).
_ITERTOOLS["groupby"] = cpython_fixes.groupby
_ITERTOOLS["zip_longest"] = cpython_fixes.zip_longest   # the same, re-entered from a map
# chain, islice, cycle, pairwise and accumulate freed the iterator they were
# running when re-entered from inside it (sandbox/safe_iterators.py).
_ITERTOOLS.update(safe_iterators.ITERTOOLS)

_JSON = _public(json, ["dumps", "loads", "JSONDecodeError"])

_DATETIME = _public(datetime, ["date", "datetime", "time", "timedelta", "timezone",
                               "tzinfo", "MINYEAR", "MAXYEAR", "UTC"])

def _time_strptime(string: Any, format: Any = "%a %b %d %H:%M:%S %Y") -> time.struct_time:
    # _strptime caches compiled formats keyed by the format object (R1).
    return time.strptime(exact(string), exact(format))


# time.sleep would hold a worker for nothing; tzset and the clock setters
# change process state.
_TIME = _public(time, ["time", "time_ns", "monotonic", "monotonic_ns", "perf_counter",
                       "perf_counter_ns", "process_time", "process_time_ns", "gmtime",
                       "localtime", "mktime", "strftime", "strptime", "asctime", "ctime",
                       "struct_time", "timezone", "altzone", "daylight", "tzname"])
_TIME["strptime"] = _time_strptime

_HASHLIB = {
    **_public(hashlib, ["md5", "sha1", "sha224", "sha256", "sha384", "sha512",
                        "sha3_224", "sha3_256", "sha3_384", "sha3_512",
                        "shake_128", "shake_256", "blake2b", "blake2s", "new", "pbkdf2_hmac"]),
    # hashlib's own are mutable, shared sets: expose frozen copies.
    "algorithms_guaranteed": frozenset(hashlib.algorithms_guaranteed),
    "algorithms_available": frozenset(hashlib.algorithms_available),
}

_HMAC = _public(hmac, ["new", "compare_digest", "digest"])

_BASE64 = _public(base64, ["b64encode", "b64decode", "standard_b64encode", "standard_b64decode",
                           "urlsafe_b64encode", "urlsafe_b64decode", "b32encode", "b32decode",
                           "b32hexencode", "b32hexdecode", "b16encode", "b16decode",
                           "b85encode", "b85decode", "a85encode", "a85decode",
                           "encodebytes", "decodebytes"])

_STRING = {**_public(string, ["ascii_letters", "ascii_lowercase", "ascii_uppercase", "digits",
                              "hexdigits", "octdigits", "punctuation", "printable",
                              "whitespace", "capwords"]),
           "Template": Template}

# deque.index is replaced where sandbox._typepatch built; OrderedDict is the
# class CPython writes in Python (sandbox/cpython_fixes.py).
_COLLECTIONS = {**_public(collections, ["Counter", "defaultdict", "deque", "namedtuple",
                                        "ChainMap"]),
                "OrderedDict": cpython_fixes.OrderedDict}

_STATISTICS = _public(statistics, ["mean", "fmean", "geometric_mean", "harmonic_mean",
                                   "median", "median_low", "median_high", "median_grouped",
                                   "mode", "multimode", "pstdev", "pvariance", "stdev",
                                   "variance", "quantiles", "correlation", "covariance",
                                   "linear_regression", "NormalDist", "StatisticsError"])

# The thread's current context (getcontext/setcontext/localcontext) and the
# DefaultContext/BasicContext/ExtendedContext templates are process state
# shared with the next invocation: a suspended `with localcontext()` or code
# running late from a finaliser could change another guild's arithmetic.
# Scripts use their own decimal.Context(...) objects instead; the runtime
# resets the thread context before each invocation.
_DECIMAL = {
    **_public(decimal, ["Decimal", "Context",
                        "DecimalException", "InvalidOperation", "DivisionByZero",
                        "Inexact", "Rounded", "Subnormal", "Overflow", "Underflow",
                        "Clamped", "FloatOperation",
                        "MAX_PREC", "MAX_EMAX", "MIN_EMIN", "MIN_ETINY"]),
    **{name: getattr(decimal, name) for name in dir(decimal) if name.startswith("ROUND_")},
}

# uuid1/getnode expose the host's MAC address (and may run subprocesses).
_UUID = _public(uuid, ["UUID", "uuid3", "uuid4", "uuid5", "NAMESPACE_DNS",
                       "NAMESPACE_URL", "NAMESPACE_OID", "NAMESPACE_X500"])

_RANDOM_METHODS: tuple[str, ...] = (
    "random", "uniform", "randint", "randrange", "choice", "choices", "shuffle",
    "sample", "gauss", "normalvariate", "lognormvariate", "expovariate",
    "vonmisesvariate", "gammavariate", "betavariate", "paretovariate",
    "weibullvariate", "triangular", "getrandbits", "randbytes", "seed",
    "getstate", "setstate",
)

STATIC_NAMESPACES: types.MappingProxyType[str, ModuleNamespace] = types.MappingProxyType({
    label: ModuleNamespace(label, members) for label, members in {
        "json": _JSON, "math": _MATH, "re": RE_MEMBERS, "datetime": _DATETIME, "time": _TIME,
        "hashlib": _HASHLIB, "hmac": _HMAC, "base64": _BASE64, "string": _STRING,
        "itertools": _ITERTOOLS, "functools": _FUNCTOOLS, "collections": _COLLECTIONS,
        "statistics": _STATISTICS, "decimal": _DECIMAL, "uuid": _UUID,
    }.items()
})

ALLOWED_MODULES: frozenset[str] = frozenset(STATIC_NAMESPACES) | {"random"}

# C functions call PyImport_Import(), which goes through the *current
# frame's* ``__import__`` (ours, while a script runs) with a list as
# fromlist, then reads the module from sys.modules itself. time.strptime and
# datetime.strptime need "_strptime", datetime methods need "time", the
# "namereplace" error handler "unicodedata" (PyCapsule_Import). For these
# names we let the call succeed and return nothing: the C caller takes the
# module from sys.modules, the script never sees it. Import statements always
# pass a tuple or None as fromlist, so a script cannot take this path.
_C_LEVEL_IMPORTS: frozenset[str] = frozenset({"_strptime", "time", "unicodedata"})


def make_random_namespace() -> ModuleNamespace:
    """A ``random`` namespace bound to a new, OS-seeded generator."""
    # 128 bits from the OS: half the cost of Random()'s 2.5 KB default seed.
    generator = random.Random(int.from_bytes(os.urandom(16), "big"))
    members: dict[str, Any] = {name: getattr(generator, name) for name in _RANDOM_METHODS}
    members["Random"] = random.Random
    members["SystemRandom"] = random.SystemRandom
    return ModuleNamespace("random", members)


def make_importer() -> Callable[..., ModuleNamespace | None]:
    """Return an ``__import__`` for one invocation.

    It resolves only the allowed top-level names, builds ``random`` lazily
    (seeding costs a few microseconds) and checks ``from x import y`` names
    itself so CPython's ``sys.modules`` fallback is never reached.
    """
    cache: dict[str, ModuleNamespace] = {}

    def restricted_import(name: Any, globals: Any = None, locals: Any = None,
                          fromlist: Any = (), level: Any = 0) -> ModuleNamespace | None:
        if type(name) is not str or type(level) is not int:
            raise ImportError("invalid import")
        if type(fromlist) is list and name in _C_LEVEL_IMPORTS and name in sys.modules:
            return None
        if level != 0:
            raise ImportError("relative imports are not allowed")
        if name not in ALLOWED_MODULES:
            raise ImportError(f"import of {name!r} is not allowed")
        ns = cache.get(name)
        if ns is None:
            if name == "random":
                ns = make_random_namespace()
            else:
                ns = STATIC_NAMESPACES[name]
                if name == "statistics":
                    # NormalDist.samples() draws from the module-global
                    # generator: no state from an earlier invocation (R8).
                    resets.reseed_library_random()
            cache[name] = ns
        if fromlist:
            if type(fromlist) is not tuple:
                raise ImportError("invalid import")
            for item in fromlist:
                if type(item) is not str or not namespace_has(ns, item):
                    shown = item if type(item) is str else "?"
                    raise ImportError(f"cannot import name {shown!r} from {name!r}")
        return ns

    restricted_import.__name__ = "__import__"
    restricted_import.__qualname__ = "__import__"
    return restricted_import
