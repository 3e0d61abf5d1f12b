"""Runtime guards and the curated builtins that restricted code runs against.

This module owns everything the transformed code calls at run time: the
``_getattr_``/``_getitem_``/``_write_``/``_getiter_``/``_apply_``/
``_inplacevar_`` hooks RestrictedPython inserts, the ``print`` collector, the
metaclass script classes get, and the immutable base of builtins. Nothing here
holds per-invocation state except :class:`PrintCollector` instances, which
``sandbox.runtime`` creates fresh for every call.

The attribute guard is name based: Python offers no other hook for every
attribute read, so each denied name below is there because it leads, directly
or in a chain, to frames, code, globals, builtins or the type hierarchy.
"""
from __future__ import annotations

import builtins
import collections
import operator
import types
from abc import ABCMeta
from collections.abc import Callable
from typing import Any

from RestrictedPython.Guards import guarded_iter_unpack_sequence, guarded_unpack_sequence
from RestrictedPython.transformer import INSPECT_ATTRIBUTES

from sandbox import cpython_fixes, safe_iterators, set_insertion, unbound

# Attribute names that are refused on every object, in addition to any name
# starting with "_" (which covers every dunder: __class__, __globals__,
# __subclasses__, __builtins__, __traceback__, __code__, __dict__, ...).
DENIED_ATTRIBUTES: frozenset[str] = INSPECT_ATTRIBUTES | frozenset({
    # frames, code and tracebacks (RestrictedPython's list plus the rest)
    "f_back", "f_builtins", "f_code", "f_globals", "f_locals", "f_trace",
    "tb_frame", "tb_next", "gi_frame", "gi_code", "gi_yieldfrom",
    "cr_frame", "cr_code", "cr_await", "cr_origin", "ag_frame", "ag_code",
    "ag_await", "co_code",
    # Python 2 era spellings that some C extensions still mirror
    "func_globals", "func_code", "func_closure", "func_defaults",
    "im_func", "im_self", "im_class", "cell_contents",
    # type.mro() hands out `object` and every base class
    "mro",
})

# Names refused only on some objects, see guarded_getattr.
_STR_FORMAT_ATTRIBUTES = frozenset({"format", "format_map"})


class ScriptType(type):
    """Metaclass of every class a script defines.

    RestrictedPython rewrites ``class C(...)`` into
    ``class C(..., metaclass=__metaclass__)``; we bind ``__metaclass__`` to
    this type so the write guard can tell script-made classes and instances
    (writable) from everything the sandbox exposes (read-only).

    Because instances are writable, a script class must not inherit C slots
    that C code trusts without checking them: ``UnicodeDecodeError.__str__``
    reads ``object`` as bytes and ``start`` as an index unchecked, so
    ``e.object = [0]; e.start = -4096; str(e)`` read the worker's memory one
    byte at a time (other guilds' leftover request data, compiled sources;
    redteam finding R2). Those bases are refused.
    """

    def __new__(mcs, name: str, bases: tuple[type, ...], namespace: dict[str, Any],
                **kwargs: Any) -> ScriptType:
        for base in bases:
            if isinstance(base, type) and issubclass(base, _UNSAFE_SCRIPT_BASES):
                raise TypeError(f"classes cannot derive from {base.__name__!s} here")
        # What a class statement can put there; a namespace from elsewhere
        # (library code calling type(self)(name, bases, dict): ChainMap.parents'
        # getter, a review, session 35) may not add __str__, __del__, ...
        if type(namespace) is not dict:     # its keys() could hide a comparison below
            raise TypeError("a class namespace must be a dict")
        for key in namespace:
            if type(key) is not str or key.startswith("_") and key not in _CLASS_BODY_NAMES:
                raise TypeError(f"a class cannot define {key!r} here")
        for method in _COMPARISONS.keys() & namespace.keys():
            namespace[method] = _decided(method, namespace[method])
        return super().__new__(mcs, name, bases, namespace, **kwargs)

    # CPython 3.11 drops a class attribute's old value before it invalidates
    # its attribute-lookup cache, which holds plain pointers (cpython#118492):
    # a generator's `finally` run by that drop read the class attribute back
    # from the cache, got the object being freed and kept it (a review,
    # session 33: a freed list handed out again as a new one; a worker
    # crash). The old value is held here until the cache is invalidated.
    def __setattr__(cls, name: str, value: Any) -> None:
        old = cls.__dict__.get(_plain_name(name))
        type.__setattr__(cls, name, value)
        del old

    def __delattr__(cls, name: str) -> None:
        old = cls.__dict__.get(_plain_name(name))
        type.__delattr__(cls, name)
        del old


def _plain_name(name: Any) -> str:
    """An attribute name a class's dictionary is looked up with: a plain
    string (a str subclass's own hash and equality would run script code)."""
    if type(name) is not str:
        raise TypeError("attribute name must be a plain string")
    return name


#: The comparisons a script class may define, and their operators.
_COMPARISONS = {"__eq__": "==", "__ne__": "!=", "__lt__": "<", "__le__": "<=",
                "__gt__": ">", "__ge__": ">="}
_CLASS_BODY_NAMES = frozenset({"__module__", "__qualname__", "__doc__", "__classcell__",
                               "__annotations__", "__init__", "__contains__", *_COMPARISONS})


def _decided(method: str, defined: Any) -> Any:
    """A script class's comparison that never answers ``NotImplemented``.

    On ``NotImplemented`` CPython calls the other operand's reflected method
    with this one's operand: C code of CPython 3.11 that compares objects it
    holds no reference to (``list`` comparison's last item, ``deque.index``,
    ``itertools.groupby``) then hands that call an object the first method
    freed (it cleared the container), and a review turned that into reading
    the worker's memory and running unrestricted code (session 25). So a
    script's comparison decides: ``NotImplemented`` from ``==``/``!=`` means
    identity, as CPython's own fallback; from an ordering, the TypeError
    CPython would raise. Only a comparison between two objects that would
    each have deferred to the other answers differently."""
    operator = _COMPARISONS[method]

    def compare(self: Any, other: Any) -> Any:
        result = defined(self, other)
        if result is NotImplemented:
            if method == "__eq__":
                return self is other
            if method == "__ne__":
                return self is not other
            raise TypeError(f"'{operator}' not supported between instances of "
                            f"{type(self).__name__!r} and {type(other).__name__!r}")
        return result

    compare.__name__ = compare.__qualname__ = method
    return compare


# Builtin classes with writable C slots that their own C methods use without
# a type or bounds check, or without holding them (see ScriptType): OSError's
# ``__str__`` formats three fields borrowed while errno's ``str()`` runs script
# code, which rebound a subclass instance's ``filename`` (red team, session 35:
# a freed object formatted). Library OSErrors (``type(caught)``) are read-only.
_UNSAFE_SCRIPT_BASES: tuple[type, ...] = (UnicodeEncodeError, UnicodeDecodeError,
                                          UnicodeTranslateError, OSError)


UNICODE_ERRORS_CHECKED = cpython_fixes.UNICODE_ERRORS_CHECKED   # see there


def guarded_getattr(obj: Any, name: str) -> Any:
    """``obj.name`` for restricted code.

    Raises AttributeError for private or denied names, NotImplementedError for
    ``format``/``format_map`` unless they resolve to a function the script
    wrote: ``str.format`` replacement fields walk attributes without this
    guard (CVE-2023-41039), and a type check on ``obj`` is not enough because
    ``super(S, s).format`` hands out ``str.format`` from a ``super`` object.
    """
    if type(name) is not str:
        raise TypeError("attribute name must be a string")
    if name.startswith("_") or name in DENIED_ATTRIBUTES:
        raise AttributeError(f'"{name}" is a forbidden attribute')
    if name == "obj" and isinstance(obj, (BaseException, super)):
        # AttributeError.obj / NameError.obj hand out the object whose lookup
        # failed, which may be a trusted one (CVE-2024-47532).
        raise AttributeError('"obj" is a forbidden attribute of exceptions')
    if name in ("fget", "fset", "fdel") and isinstance(obj, property):
        return unbound.property_function(obj, name, _is_script_function)
    if name == "register" and isinstance(obj, ABCMeta):
        # ABCMeta.register changes isinstance() for the whole process
        # (collections.ChainMap.register(str), redteam finding 1).
        raise AttributeError('"register" is a forbidden attribute of abstract classes')
    value = getattr(obj, name)
    if name in _STR_FORMAT_ATTRIBUTES and not _is_script_function(value):
        raise NotImplementedError(f"str.{name}() is not allowed; use %-formatting or f-strings")
    if type(value) is types.FunctionType and isinstance(obj, (type, super)) \
            and not _is_script_function(value):
        return unbound.checked(obj, name, value, ScriptType)  # Counter.copy(int): unbound.py
    return value


def _is_script_function(value: Any) -> bool:
    """True for functions (or methods of functions) compiled from a script.

    Their globals are an invocation's scope, which holds our guards; no
    trusted module has a global named ``_getattr_``.
    """
    func = value.__func__ if type(value) is types.MethodType else value
    return type(func) is types.FunctionType and \
        func.__globals__.get("_getattr_") is guarded_getattr


def guarded_getitem(obj: Any, key: Any) -> Any:
    """``obj[key]`` for restricted code; nothing reachable needs more."""
    return obj[key]


# Containers a script may assign items or attributes into. Every instance of
# these that a script can reach was made by the script itself or is a fresh
# copy (event fields), so writing into them touches no shared state.
_WRITABLE_TYPES: frozenset[type] = frozenset({
    dict, list, bytearray, set,
    cpython_fixes.OrderedDict, collections.defaultdict, collections.Counter,
    collections.deque, collections.ChainMap,
})


def guarded_write(obj: Any) -> Any:
    """Return ``obj`` if restricted code may assign to its items or attributes.

    Raises TypeError for everything the script did not create: exposed
    classes, functions, module namespaces, the event object.
    """
    tp = type(obj)
    if tp in _WRITABLE_TYPES or isinstance(tp, ScriptType) or tp is ScriptType:
        return obj
    raise TypeError(f"cannot assign to attributes or items of {tp.__name__!s} objects")


def guarded_apply(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``func(*args, **kwargs)``: star-args need no extra checks here."""
    return func(*args, **kwargs)


_INPLACE_OPERATORS: dict[str, Callable[[Any, Any], Any]] = {
    "+=": operator.iadd, "-=": operator.isub, "*=": operator.imul,
    "/=": operator.itruediv, "//=": operator.ifloordiv, "%=": operator.imod,
    "**=": operator.ipow, "<<=": operator.ilshift, ">>=": operator.irshift,
    "&=": operator.iand, "|=": operator.ior, "^=": operator.ixor,
    "@=": operator.imatmul,
}


def guarded_inplacevar(op: str, target: Any, value: Any) -> Any:
    """``target op= value`` for plain names.

    ``d |= other`` on a dict whose ``|=`` is dict's own is ``dict.update``
    (the process's, see ``sandbox.dict_tables``): CPython's C ``|=`` copies
    the other dict's table into an empty dict, which a script's comparison
    run under an insertion could use to give the dict a table of the wrong
    kind."""
    try:
        func = _INPLACE_OPERATORS[op]
    except KeyError:
        raise TypeError(f"unsupported in-place operator {op!r}") from None
    if op == "|=" and isinstance(target, dict) and type(target).__ior__ is _DICT_IOR:
        dict.update(target, value)
        return target
    if isinstance(target, set):   # the checked set methods (sandbox.set_insertion)
        done = set_insertion.in_place(op, target, value)
        if done is not NotImplemented:
            return done
    return func(target, value)


_DICT_IOR = dict.__ior__


def safe_type(obj: Any) -> type:
    """One-argument ``type()``.

    Refuses three arguments (a class dict from strings would bypass every
    name check) and refuses to return metaclasses: ``type(type(x))`` would be
    ``type`` itself, i.e. the three-argument form again.
    """
    tp = type(obj)
    if issubclass(tp, type):
        raise TypeError("type() of a class is not available")
    if not UNICODE_ERRORS_CHECKED and tp in _UNSAFE_SCRIPT_BASES:
        raise TypeError(f"type() of a {tp.__name__} is not available here")
    return tp


def _type_with_arity_check(*args: Any) -> type:
    if len(args) != 1:
        raise TypeError("type() takes exactly one argument here")
    return safe_type(args[0])


_type_with_arity_check.__name__ = "type"
_type_with_arity_check.__qualname__ = "type"


class PrintCollector:
    """Captures ``print`` output of one invocation, capped in UTF-8 bytes.

    RestrictedPython turns ``print(...)`` into
    ``_print = _print_(_getattr_); _print._call_print(...)`` per scope; the
    runtime's ``_print_`` returns this one collector for every scope so the
    cap is global to the invocation.
    """

    __slots__ = ("_parts", "_size", "_cap", "_truncated")

    TRUNCATED_MARKER = "\n[output truncated]\n"

    def __init__(self, cap: int) -> None:
        self._parts: list[str] = []
        self._size = 0
        self._cap = cap
        self._truncated = False

    def __call__(self, _getattr_: Any = None) -> PrintCollector:
        return self

    def _call_print(self, *objects: Any, sep: Any = None, end: Any = None,
                    file: Any = None, flush: Any = False) -> None:
        if file is not None:
            raise TypeError("print(file=...) is not supported")
        if sep is not None and type(sep) is not str:
            raise TypeError("sep must be None or a string")
        if end is not None and type(end) is not str:
            raise TypeError("end must be None or a string")
        if self._truncated:
            return
        # str() may return a str subclass; join always builds an exact str.
        separator = " " if sep is None else sep
        text = separator.join([str(o) for o in objects]) + ("\n" if end is None else end)
        data = text.encode("utf-8", "backslashreplace")
        room = self._cap - self._size
        if len(data) <= room:
            self._parts.append(data.decode("utf-8"))
            self._size += len(data)
            return
        self._parts.append(data[:max(room, 0)].decode("utf-8", "ignore"))
        self._parts.append(self.TRUNCATED_MARKER)
        self._size = self._cap
        self._truncated = True

    def text(self) -> str:
        """Everything printed so far (plain, valid UTF-8 text)."""
        return "".join(self._parts)


_SAFE_BUILTIN_NAMES: tuple[str, ...] = (
    "None", "False", "True", "Ellipsis", "NotImplemented",
    "abs", "all", "any", "ascii", "bin", "bool", "bytearray", "bytes",
    "callable", "chr", "classmethod", "complex", "dict", "divmod",
    "enumerate", "filter", "float", "format", "frozenset", "hash", "hex",
    "int", "isinstance", "issubclass", "iter", "len", "list", "map", "max",
    "min", "next", "object", "oct", "ord", "pow", "property", "range",
    "repr", "reversed", "round", "set", "slice", "sorted", "staticmethod",
    "str", "sum", "super", "tuple", "zip",
    # exceptions a script may raise or catch
    "ArithmeticError", "AssertionError", "AttributeError", "BaseException",
    "Exception", "IndexError", "KeyError", "LookupError", "MemoryError",
    "NameError", "NotImplementedError", "OverflowError", "RecursionError",
    "RuntimeError", "StopIteration", "TypeError", "UnicodeDecodeError",
    "UnicodeEncodeError", "UnicodeError", "ValueError", "ZeroDivisionError",
    "ImportError", "ModuleNotFoundError", "UnboundLocalError",
)
# Deliberately absent: getattr, setattr, delattr, hasattr, vars, dir,
# globals, locals, eval, exec, compile, open, input, breakpoint, help,
# memoryview, id (addresses help exploits), __import__ (per invocation, see
# sandbox.runtime), aiter/anext (async is rejected at compile time),
# ExceptionGroup/BaseExceptionGroup (CVE-2025-22153), exit/quit, print
# (rewritten by the compiler).

# Private dicts (``dict.copy`` of a dict is several times faster than
# copying a mappingproxy); only read-only views are exported. The runtime
# copies them for every invocation, so a script never holds the originals.
_BASE_BUILTINS: dict[str, Any] = {
    **{name: getattr(builtins, name) for name in _SAFE_BUILTIN_NAMES
       if UNICODE_ERRORS_CHECKED or name not in ("UnicodeDecodeError", "UnicodeEncodeError")},
    "type": _type_with_arity_check,
    "classmethod": unbound.script_classmethod,
    # iter(function, sentinel) compared a sentinel it could drop meanwhile:
    # a generator holds it (sandbox/safe_iterators.py); iter(x) is CPython's.
    "iter": safe_iterators.iter,
    "__build_class__": builtins.__build_class__,
}
BASE_BUILTINS: types.MappingProxyType[str, Any] = types.MappingProxyType(_BASE_BUILTINS)

# Guards shared by every invocation: plain functions with no state.
_BASE_GUARDS: dict[str, Any] = {
    "_getattr_": guarded_getattr,
    "_getitem_": guarded_getitem,
    "_write_": guarded_write,
    "_getiter_": iter,
    "_iter_unpack_sequence_": guarded_iter_unpack_sequence,
    "_unpack_sequence_": guarded_unpack_sequence,
    "_apply_": guarded_apply,
    "_inplacevar_": guarded_inplacevar,
    "__metaclass__": ScriptType,
    "__name__": "script",
}
BASE_GUARDS: types.MappingProxyType[str, Any] = types.MappingProxyType(_BASE_GUARDS)


def fresh_builtins() -> dict[str, Any]:
    """A new builtins dict for one invocation (without ``__import__``)."""
    return _BASE_BUILTINS.copy()


def fresh_globals() -> dict[str, Any]:
    """A new globals dict holding the guards, for one invocation."""
    return _BASE_GUARDS.copy()

