"""A dict's table must not turn "string keys only" under an insertion.

CPython 3.11 keeps two kinds of dict table: one for exact ``str`` keys only,
whose lookups read each key as a string without looking at its type, and a
general one. ``d[k] = v`` and ``d.setdefault(k, v)`` make the table general
for a key ``k`` that is not a string, *then* look ``k`` up, which can run a
script's code (a comparison reaching a script's property or ``tzinfo``),
and then store ``k`` in whatever table the dict has by then. If that code
emptied the dict with ``clear()`` (which installs the shared empty table, of
the string kind), or emptied it and refilled it with ``update``/``|=`` from
a dict of strings (which copies that dict's table), ``k`` went into a
string-only table: a later lookup with a string read the key's memory as a
string header, with a data pointer the script chose (a review, session 31:
a crash of the worker, and a comparison oracle on its memory).

So, in every process that runs scripts (``sandbox.runtime`` installs this):

* ``dict.clear`` removes the items one by one (the table keeps its kind),
  never installing the shared empty one;
* ``dict.update`` inserts key by key, never copying the other dict's table
  (a generator given to it can empty the dict before its keywords are
  merged: a review of the first version of this fix); the runtime's ``|=``
  on a dict goes through ``dict.update``
  (``sandbox.guards.guarded_inplacevar``);
* scripts' ``functools.lru_cache`` and ``cache`` are CPython's Python
  versions, whose ``cache_clear`` is ``dict.clear`` (the C one cleared its
  cache table from C, out of reach of the above);
* a ``Fraction`` is made of two exact integers: a script's ``int`` subclass
  with a ``numerator`` property put any object there, and a ``Fraction``
  hashes like an integer while its comparison ran that object's ``__eq__``.

Both are slower than CPython's C (a Python loop per item) and answer the
same; a cleared dict keeps its table's size until it grows again.
"""
from __future__ import annotations

import fractions
import functools
import types
from typing import Any

from sandbox.cpython_fixes import python_copy

_clear = dict.clear
_update = dict.update
_set = dict.__setitem__
_popitem = dict.popitem
_len = dict.__len__
_items = dict.items
_dict_iter = dict.__iter__
_NOTHING: Any = object()
#: ``dict.clear`` as CPython has it, for the runtime's own dicts that no
#: insertion can be under (a script's globals after its run).
original_clear = _clear


def dict_clear(self: dict[Any, Any]) -> None:
    """D.clear() -> None.  Remove all items from D."""
    if not isinstance(self, dict):
        _clear(self)          # the original's own error
    # Item by item, last first: the table keeps its kind, nothing is allocated
    # but each (key, value) pair (a MemoryError leaves the dict half cleared,
    # never with the shared empty table).
    while _len(self):
        _popitem(self)


def dict_update(self: dict[Any, Any], other: Any = _NOTHING, /, **kwargs: Any) -> None:
    """D.update([E, ]**F) -> None.  Update D from dict/iterable E and F.
    If E is present and has a .keys() method, then does:  for k in E: D[k] = E[k]
    If E is present and lacks a .keys() method, then does:  for k, v in E: D[k] = v
    In either case, this is followed by: for k in F:  D[k] = F[k]"""
    if not isinstance(self, dict):
        _update(self)         # the original's own error
    # Key by key, as CPython does for anything but a dict into an empty dict,
    # where it copies the other's table instead (see the module's docstring).
    if other is not _NOTHING:
        if isinstance(other, dict) and type(other).__iter__ is _dict_iter:
            for key, value in _items(other):   # a dict changed meanwhile: RuntimeError
                _set(self, key, value)
        elif hasattr(other, "keys"):
            for key in list(other.keys()):
                _set(self, key, other[key])
        else:
            for index, item in enumerate(other):
                try:
                    pair = tuple(item)
                except TypeError:
                    raise TypeError(f"cannot convert dictionary update sequence element "
                                    f"#{index} to a sequence") from None
                if len(pair) != 2:
                    raise ValueError(f"dictionary update sequence element #{index} has "
                                     f"length {len(pair)}; 2 is required")
                _set(self, pair[0], pair[1])
    for key, value in _items(kwargs):
        _set(self, key, value)


def _checked_fraction_new(original: Any) -> Any:
    def __new__(cls: type, numerator: Any = 0, denominator: Any = None, *,
                _normalize: bool = True) -> Any:
        made = original(cls, numerator, denominator, _normalize=_normalize)
        if type(made._numerator) is not int or type(made._denominator) is not int:
            raise TypeError("a Fraction's numerator and denominator must be integers")
        return made
    __new__.__doc__ = original.__doc__
    __new__.checks_parts = True   # type: ignore[attr-defined]
    return __new__


def _python_functools() -> types.ModuleType:
    """``functools`` as CPython writes it in Python (``_functools`` blocked)."""
    module = python_copy("functools", "_functools")
    if not isinstance(module._lru_cache_wrapper, types.FunctionType):
        raise ImportError("functools' Python lru_cache could not be loaded")
    # The cache's wrapper copied the cached callable's __dict__: given a
    # library class, its methods as raw functions, past the attribute guard's
    # check of what they are called on (a review, session 35). Scripts cannot
    # set attributes of functions, so nothing of theirs is lost.
    setattr(module, "update_wrapper", functools.partial(module.update_wrapper, updated=()))
    return module


_PYTHON_FUNCTOOLS = _python_functools()
#: What scripts get as ``functools.lru_cache`` and ``functools.cache``.
lru_cache = _PYTHON_FUNCTOOLS.lru_cache
cache = _PYTHON_FUNCTOOLS.cache


def install() -> bool:
    """Put ``dict_clear``/``dict_update`` in ``dict`` and the part check in
    ``Fraction``, once per process; whether they are in place."""
    if not _fraction_checked():
        original = fractions.Fraction.__dict__["__new__"].__func__
        fractions.Fraction.__new__ = staticmethod(_checked_fraction_new(original))  # type: ignore
    try:
        from sandbox import _typepatch
    except ImportError:
        return False
    for name, function in (("clear", dict_clear), ("update", dict_update)):
        if dict.__dict__.get(name) is not function:
            _typepatch.set_attribute(dict, name, function)
    return installed()


def _fraction_checked() -> bool:
    return getattr(fractions.Fraction.__dict__["__new__"].__func__, "checks_parts", False)


def installed() -> bool:
    """Whether this process's ``dict`` and ``Fraction`` are the checked ones."""
    return (dict.__dict__.get("clear") is dict_clear
            and dict.__dict__.get("update") is dict_update
            and _fraction_checked())
