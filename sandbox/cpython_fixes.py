"""Replacements for C code of CPython 3.11 that a script can make use freed memory.

A script may define ``__eq__`` (and the other comparisons), and C code that
compares an object it holds no reference to runs that method while the
object can be freed: a use after free inside the worker. A review (session
25) turned the first below into reading the worker's memory and running
unrestricted code in it (the worker's own walls held: no file, no socket,
user ``nobody``), and crashed workers with the second:

* ``collections.deque.index`` compared each item borrowed; an item whose
  ``__eq__`` clears the deque is freed mid-comparison (CPython gh-115243,
  fixed in 3.11.9 and 3.12.3). Replaced in the type itself, for every deque
  and subclass, by ``_deque_index`` (``sandbox/_typepatch.c``): it walks the
  deque with its iterator, which holds each item and refuses a deque changed
  meanwhile, as the C code promised (``METHODS_REPLACED``: whether the
  extension built).
* ``itertools.groupby`` compared its current and target keys borrowed; a key
  whose ``__eq__`` advances the groupby freed one of them. Scripts get
  ``groupby`` below instead: the pure-Python equivalent from the
  ``itertools`` documentation, whose re-entry is an error ("generator
  already executing"), never freed memory.

Both behave as the originals for every script that does not change what it
is iterating. ``OrderedDict`` (below) is the class CPython writes in Python:
its C lookups and ``copy`` used freed memory when a key's comparison
emptied the dict (review, session 26).

Three more, found by the next review, need no ``NotImplemented`` and are
replaced in C (``sandbox/_typepatch.c``, ``SLOTS_REPLACED``): a list's
extended-slice assignment from a generator that shrinks the list wrote past
its new end; list comparison's last item was compared unheld (CPython
gh-120298, never fixed in 3.11), so an inner list emptied from a script's
``__eq__`` was read freed; ``bytearray % args`` read its format from a
buffer a script's ``__repr__`` could clear (another object's bytes and a
heap address came back in a reply); and ``OrderedDict`` equality compared
keys unheld from two dicts a script could empty meanwhile (CPython gh-119004).

The first two bugs (and list comparison's)
need a comparison that answers ``NotImplemented``, so that CPython calls the
other operand's reflected method with the freed object: a script's
comparisons never do (``sandbox.guards.ScriptType``), which narrows that
class of bug, but a library comparison written in Python can run a script's
code (a property of its subclass) and then answer ``NotImplemented`` itself
(``Fraction``'s, review session 30): these replacements close the routes
found. Iterators that free what they run are replaced in
``sandbox.safe_iterators``.
"""
from __future__ import annotations

import collections
import collections.abc
import decimal
import importlib
import importlib.util
import itertools
import operator
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def _deque_index(self: collections.deque[Any], value: Any, start: Any = 0,
                 stop: Any = sys.maxsize) -> int:
    """D.index(value, [start, [stop]]) -> integer -- return first index of value.
    Raises ValueError if the value is not present."""
    n = len(self)
    start, stop = operator.index(start), operator.index(stop)
    if start < 0:
        start = max(start + n, 0)
    if stop < 0:
        stop = max(stop + n, 0)
    i = 0
    for item in self:     # the iterator holds each item; a changed deque is a RuntimeError
        if i >= stop:
            break
        if i >= start and (item is value or item == value):
            return i
        i += 1
    raise ValueError(f"{value!r} is not in deque")


def _defaultdict_missing(self: collections.defaultdict[Any, Any], key: Any) -> Any:
    """``defaultdict.__missing__`` holding its factory while it runs.

    CPython 3.11's C version calls ``self.default_factory`` without a
    reference of its own, and a script may assign that attribute: a factory
    that was the only holder of a C method (``functools.partial(lst.index,
    x)`` with ``lst`` dropped) is freed, with the list it was running on,
    when the script's ``__eq__`` that the method calls sets
    ``default_factory = None`` - the method goes on reading the freed list,
    whose memory the script refilled with pointers of its choosing (review,
    session 30). Here the local ``factory`` keeps it alive for the whole call."""
    factory = self.default_factory
    if factory is None:
        raise KeyError(key)
    value = factory()
    self[key] = value
    return value


class ContextSignals(collections.abc.Mapping):  # type: ignore[type-arg]
    """A ``decimal.Context``'s ``flags`` or ``traps``, read live, holding the context.

    CPython 3.11's own (a ``SignalDict``) holds a bare pointer into its context
    and no reference to it: ``decimal.Context().flags`` outlived the context,
    read the next object put in its memory and, through ``update()``, changed
    its bits (a red-team pass, session 35: an immutable ``bytes`` changed, a
    heap address read, a worker crash). Scripts get this read-only view
    instead (``sandbox/_decimal_signals.c`` wraps what the type's attribute
    lookup answers for the two names); the signals are
    set when a context is made (``Context(traps=[decimal.Inexact])``) or
    cleared by its ``clear_flags()``/``clear_traps()``."""

    __slots__ = ("_context", "_signals")

    def __init__(self, context: Any, signals: Any) -> None:
        self._context = context
        self._signals = signals

    def __getitem__(self, signal: Any) -> bool:
        return bool(self._signals[signal])

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._signals))

    def __len__(self) -> int:
        return len(self._signals)

    def __repr__(self) -> str:
        return repr(self._signals)

    def copy(self) -> dict[Any, bool]:
        """A plain dict of the signals now (as CPython's ``copy()``)."""
        return dict(self)


#: CPython 3.11 before 3.11.9 lacks upstream fixes of memory bugs scripts can
#: reach (gh-115243, gh-115618): the known ones are worked around here, and
#: the pool warns at start on such an interpreter.
BEFORE_3_11_9 = sys.version_info < (3, 11, 9)
#: Such a CPython released ``None`` once more than it held it in
#: ``property.getter(None)`` (and ``setter``, ``deleter``; gh-115618): a loop of
#: such calls ended the worker with "deallocating None" (review, session 30).
PROPERTY_NONE_BUG = BEFORE_3_11_9


def _refusing_none(name: str, original: Any) -> Callable[[property, Any], property]:
    def copy_with(self: property, function: Any) -> property:
        if function is None:
            raise TypeError(f"property.{name}(None) is not supported")
        result: property = original(self, function)
        return result
    copy_with.__name__ = copy_with.__qualname__ = name
    copy_with.__doc__ = original.__doc__
    return copy_with


def _replace_methods() -> bool:
    """``deque.index``, ``defaultdict.__missing__`` and, where CPython has
    gh-115618, ``property.getter``/``setter``/``deleter``: replaced in the
    types themselves (every instance and subclass), once per process."""
    try:
        from sandbox import _typepatch
    except ImportError:
        return False
    replacements: list[tuple[type, str, Any]] = [
        (collections.deque, "index", _deque_index),
        (collections.defaultdict, "__missing__", _defaultdict_missing)]
    if PROPERTY_NONE_BUG:
        for name in ("getter", "setter", "deleter"):
            original = property.__dict__[name]
            if type(original) is not types.FunctionType:
                replacements.append((property, name, _refusing_none(name, original)))
    for tp, name, function in replacements:
        if tp.__dict__.get(name) is not function:
            _typepatch.set_attribute(tp, name, function)
    return all(tp.__dict__.get(name) is function for tp, name, function in replacements)


#: Whether ``deque.index``, ``defaultdict.__missing__`` (and ``property``'s
#: copies where needed) are ours in this process (sandbox._typepatch built).
METHODS_REPLACED: bool = _replace_methods()


def _install(extension: str, *args: Any) -> Any:
    """``sandbox.<extension>.install(*args)``, once per process (each is
    idempotent); False when the extension was not built."""
    try:
        module = importlib.import_module(f"sandbox.{extension}")
    except ImportError:
        return False
    return module.install(*args)


#: Whether the list and bytearray slots are replaced in this process (the
#: five slots of ``sandbox/_typepatch.c``).
SLOTS_REPLACED: bool = _install("_typepatch") == 5
#: Whether ``datetime.date``, ``datetime`` and ``time`` refuse a pickled state
#: with a field out of range (``sandbox/_datetime_state.c``).
DATETIME_STATES_CHECKED: bool = bool(_install("_datetime_state"))
#: Whether ``decimal.Context``'s ``flags`` and ``traps`` are `ContextSignals`,
#: holding their context (``sandbox/_decimal_signals.c``).
DECIMAL_SIGNALS_HELD: bool = bool(_install("_decimal_signals", decimal.Context, ContextSignals))


def zip_longest(*iterables: Iterable[Any], fillvalue: Any = None) -> Iterator[tuple[Any, ...]]:
    """``itertools.zip_longest`` as the ``itertools`` documentation writes it in
    Python: CPython 3.11's C version, re-entered from an iterator it was
    advancing (a ``map`` whose function calls ``next`` on the zip), released
    that iterator twice (a further review, session 25). Here re-entry is
    "generator already executing"."""
    iterators: list[Iterator[Any]] = [iter(it) for it in iterables]
    active = len(iterators)
    if not active:
        return
    while True:
        values = []
        for i, it in enumerate(iterators):
            try:
                value = next(it)
            except StopIteration:
                active -= 1
                if not active:
                    return
                iterators[i] = itertools.repeat(fillvalue)
                value = fillvalue
            values.append(value)
        yield tuple(values)


def _same(value: Any) -> Any:
    return value


def groupby(iterable: Iterable[Any], key: Callable[[Any], Any] | None = None
            ) -> Iterator[tuple[Any, Iterator[Any]]]:
    """Make an iterator that returns consecutive keys and groups from the iterable
    (``itertools.groupby``, as the ``itertools`` documentation writes it in Python)."""
    keyfunc: Callable[[Any], Any] = _same if key is None else key
    iterator = iter(iterable)
    exhausted = False
    curr_value: Any = None
    curr_key: Any = None

    def _grouper(target_key: Any) -> Iterator[Any]:
        nonlocal curr_value, curr_key, exhausted
        yield curr_value
        for curr_value in iterator:
            curr_key = keyfunc(curr_value)
            if curr_key != target_key:
                return
            yield curr_value
        exhausted = True

    try:
        curr_value = next(iterator)
    except StopIteration:
        return
    curr_key = keyfunc(curr_value)

    while not exhausted:
        target_key = curr_key
        curr_group = _grouper(target_key)
        yield curr_key, curr_group
        if curr_key == target_key:
            for _ in curr_group:
                pass


def python_copy(name: str, accelerator: str) -> types.ModuleType:
    """A second copy of the standard module ``name``, loaded while its C
    accelerator ``accelerator`` cannot be imported: the module as CPython
    writes it in Python (``sys.modules`` keeps the usual one)."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.loader is not None
    saved = sys.modules.get(accelerator)
    sys.modules[accelerator] = None  # type: ignore[assignment]  # its import fails
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del sys.modules[accelerator]
        else:
            sys.modules[accelerator] = saved
    return module


def _python_ordered_dict() -> type[collections.OrderedDict[Any, Any]]:
    """``collections.OrderedDict`` as CPython writes it in Python (the class its
    ``collections`` defines and then replaces with the C one), loaded once
    from a second copy of the module in which ``_collections`` cannot be
    imported.

    The C class's lookups kept an index into its node table across the key
    comparison, and ``copy`` walked its nodes without holding them: a key
    whose comparison runs script code (an aware ``datetime`` with the
    script's own ``tzinfo``) that clears the dict made ``od[k] = v`` write
    past the new table and ``od.copy()`` follow a pointer the script had
    sprayed (review, session 26; the C comparison, gh-119004, was replaced
    before). Every method here is Python over a ``dict`` and linked nodes:
    a dict changed under it is a ``KeyError`` or a wrong answer, never freed
    memory."""
    cls: type[collections.OrderedDict[Any, Any]] = python_copy("collections",
                                                               "_collections").OrderedDict
    if cls is collections.OrderedDict or not isinstance(cls.__dict__.get("__setitem__"),
                                                        types.FunctionType):
        raise ImportError("collections.OrderedDict in Python could not be loaded")
    return cls


#: What scripts get as ``collections.OrderedDict``.
OrderedDict = _python_ordered_dict()


#: Whether the three Unicode error classes' constructors refuse a start or end
#: outside the object (``sandbox/_unicode_errors.c``): their ``__str__`` reads
#: the object at ``start`` unchecked, so ``str(UnicodeDecodeError("x", b"A",
#: -4096, -4095, "r"))`` read the worker's memory (security review, session
#: 16). False when the extension is missing: scripts then get neither the
#: classes' names nor ``type()`` of such an error (they catch ``UnicodeError``).
UNICODE_ERRORS_CHECKED: bool = bool(_install("_unicode_errors"))
