"""A set must not change while one of its insertions compares keys.

CPython 3.11's ``set_add_entry`` (every way of adding to an existing set:
``add``, ``update``, ``|=``, ``^=``, ``symmetric_difference_update``)
remembers the first free ("dummy") slot it passes, then compares the new key
with a later key of the same hash, which can run a script's code (an aware
``datetime`` whose ``tzinfo`` is the script's; a library comparison reading
a property of a script's ``int`` subclass). It checks afterwards only that
the compared key is still in place, not that the remembered slot is still
free: code that added a key into that slot had it overwritten, its reference
lost and the set's count one too high, and clearing or freeing the set then
walked past the end of its table, releasing whatever followed it in memory
(a crash of a real worker: a review, session 31).

So, in every process that runs scripts (``sandbox.runtime`` installs this),
the set methods that change a set refuse to run on a set one of whose
insertions is in progress (``RuntimeError``, like a dict changed during
iteration): ``add``, ``update`` and ``symmetric_difference_update`` mark the
set while they insert (not while they read the items of an iterator given
to them, between which a generator may change the set, as in CPython);
those and ``discard``, ``remove``, ``pop``, ``clear``, ``difference_update``
and ``intersection_update`` refuse a marked set. The runtime's in-place operators on sets go through these methods
(``sandbox.guards.guarded_inplacevar``). Everything else a script can do to
a set (reading, comparing, iterating) is unchanged, and so is every set no
insertion is running on.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: ids of the sets an insertion is running on (this process has one thread
#: running scripts; an id is marked only for the length of one call).
_inserting: set[int] = set()
_originals: dict[str, Any] = {name: set.__dict__[name] for name in (
    "add", "update", "symmetric_difference_update", "discard", "remove", "pop", "clear",
    "difference_update", "intersection_update")}
# The originals, for the marks themselves (a set of ints: no comparison runs code).
_mark, _unmark = _originals["add"], _originals["discard"]


def _inserting_method(name: str) -> Callable[..., Any]:
    original = _originals[name]

    def method(self: set[Any], *args: Any) -> Any:
        key = id(self)
        if key in _inserting:
            raise RuntimeError("set changed while one of its insertions compared keys")
        try:
            # Inside: a MemoryError from growing the marks' own table after
            # the mark went in must not leave the set marked.
            _mark(_inserting, key)
            return original(self, *args)
        finally:
            _unmark(_inserting, key)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = original.__doc__
    return method


def _checked_method(name: str) -> Callable[..., Any]:
    original = _originals[name]

    def method(self: set[Any], *args: Any) -> Any:
        if id(self) in _inserting:
            raise RuntimeError("set changed while one of its insertions compared keys")
        return original(self, *args)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = original.__doc__
    return method


_TABLES = (set, frozenset, dict)
_add = _inserting_method("add")
_update = _inserting_method("update")
_symmetric_update = _inserting_method("symmetric_difference_update")


def update(self: set[Any], *others: Any) -> None:
    """Update a set with the union of itself and others."""
    for other in others:
        if isinstance(other, _TABLES):
            _update(self, other)      # read from a table: only comparisons run code
        else:
            # Items pulled from an iterator (a generator may change this set
            # between them, as in CPython); only each insertion is marked.
            for item in other:
                _add(self, item)


def symmetric_difference_update(self: set[Any], other: Any) -> None:
    """Update a set with the symmetric difference of itself and another."""
    if not isinstance(other, _TABLES):
        other = set(other)            # as CPython does first, outside the mark
    _symmetric_update(self, other)


REPLACEMENTS: dict[str, Callable[..., Any]] = {
    "add": _add, "update": update, "symmetric_difference_update": symmetric_difference_update,
    **{name: _checked_method(name) for name in ("discard", "remove", "pop", "clear",
                                                "difference_update", "intersection_update")},
}

#: The in-place operators on a set, as the methods above (``s |= t`` is
#: ``s.update(t)`` when ``t`` is a set or frozenset, as CPython requires).
_IN_PLACE: dict[str, tuple[str, str]] = {
    "|=": ("__ior__", "update"), "&=": ("__iand__", "intersection_update"),
    "-=": ("__isub__", "difference_update"), "^=": ("__ixor__", "symmetric_difference_update")}


def in_place(op: str, target: Any, value: Any) -> Any:
    """``target op= value`` through the checked methods when ``target`` is a set
    whose operator is set's own and ``value`` a set or frozenset; else
    ``NotImplemented`` (the caller applies the operator)."""
    entry = _IN_PLACE.get(op)
    if entry is None or not isinstance(target, set) or not isinstance(value, (set, frozenset)):
        return NotImplemented
    slot, name = entry
    if getattr(type(target), slot) is not set.__dict__[slot]:
        return NotImplemented
    REPLACEMENTS[name](target, value)
    return target


def install() -> bool:
    """Put the checked methods in ``set``, once per process; whether they are."""
    try:
        from sandbox import _typepatch
    except ImportError:
        return False
    for name, function in REPLACEMENTS.items():
        if set.__dict__.get(name) is not function:
            _typepatch.set_attribute(set, name, function)
    return installed()


def installed() -> bool:
    return all(set.__dict__.get(name) is function for name, function in REPLACEMENTS.items())
