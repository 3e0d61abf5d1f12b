"""Iterators scripts get in place of CPython 3.11's C ones that free what they run.

A C iterator that calls its inner iterator (or function) without a reference
of its own, and drops that inner object when it runs out, frees it while it
is still running if the script re-enters the outer iterator from inside
(``next(outer)`` from a comparison the inner call makes) and that nested call
runs it dry: ``chain``, ``islice`` and ``cycle`` dropped a ``map(lst.index,
...)`` that alone held a list, and ``list.index`` read on in the freed list,
whose memory the script had refilled with a pointer to its own object
(review, session 30). ``iter(function, sentinel)`` compared a sentinel it
dropped the same way. ``pairwise`` and ``accumulate`` drop or replace what
they hold the same way, so they are replaced as well; ``count`` returned the
value it holds after adding to it, and a script's code inside that addition
that advanced the same count got that value too, then freed it under the
outer call (a second review, same session: a reference into memory the
script refilled).

Each replacement below is the pure-Python equivalent from the ``itertools``
documentation: a generator, whose locals hold what it runs and whose
re-entry is an error ("generator already executing"), never freed memory.
Arguments are checked when the iterator is made, as the C versions do.
``groupby`` and ``zip_longest`` are in ``sandbox.cpython_fixes``.
"""
from __future__ import annotations

import builtins
import numbers
import operator
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def _chain(iterables: Iterable[Iterable[Any]]) -> Iterator[Any]:
    for iterable in iterables:
        yield from iterable


def chain(*iterables: Iterable[Any]) -> Iterator[Any]:
    """chain(*iterables) --> chain object (itertools.chain, as a generator)"""
    return _chain(iterables)


def _from_iterable(iterables: Iterable[Iterable[Any]]) -> Iterator[Any]:
    """chain.from_iterable(iterable) --> chain object"""
    return _chain(builtins.iter(iterables))


chain.from_iterable = _from_iterable  # type: ignore[attr-defined]


def _index(value: Any, what: str) -> int | None:
    if value is None:
        return None
    try:
        index = operator.index(value)
    except TypeError:
        index = -1
    if not 0 <= index <= sys.maxsize:
        raise ValueError(f"{what} for islice() must be None or an integer: 0 <= x <= sys.maxsize.")
    return index


def islice(iterable: Iterable[Any], *args: Any) -> Iterator[Any]:
    """islice(iterable, stop) --> islice object
    islice(iterable, start, stop[, step]) --> islice object"""
    if not 1 <= len(args) <= 3:
        raise TypeError(f"islice expected at most 4 arguments, got {len(args) + 1}")
    if len(args) == 1:
        start, stop, step = 0, _index(args[0], "Stop argument"), 1
    else:
        start = _index(args[0], "Indices") or 0
        stop = _index(args[1], "Indices")
        step = 1
        if len(args) == 3 and args[2] is not None:
            try:
                step = operator.index(args[2])
            except TypeError:
                step = 0
            if step < 1:
                raise ValueError("Step for islice() must be a positive integer or None.")
    return _islice(builtins.iter(iterable), start, sys.maxsize if stop is None else stop, step)


def _islice(iterator: Iterator[Any], start: int, stop: int, step: int) -> Iterator[Any]:
    indexes = builtins.iter(range(start, stop, step))
    try:
        wanted = next(indexes)
    except StopIteration:
        for _ in zip(range(start), iterator):   # consumed up to start, as the C one does
            pass
        return
    for i, element in enumerate(iterator):
        if i == wanted:
            yield element
            try:
                wanted = next(indexes)
            except StopIteration:
                for _ in zip(range(i + 1, stop), iterator):   # consumed up to stop, as there
                    pass
                return


def cycle(iterable: Iterable[Any]) -> Iterator[Any]:
    """cycle(iterable) --> cycle object"""
    return _cycle(builtins.iter(iterable))


def _cycle(iterator: Iterator[Any]) -> Iterator[Any]:
    saved = []
    for element in iterator:
        yield element
        saved.append(element)
    while saved:
        yield from saved


def pairwise(iterable: Iterable[Any]) -> Iterator[tuple[Any, Any]]:
    """pairwise(iterable) --> pairwise object"""
    return _pairwise(builtins.iter(iterable))


def _pairwise(iterator: Iterator[Any]) -> Iterator[tuple[Any, Any]]:
    for a in iterator:
        for b in iterator:
            yield a, b
            a = b
        return


def accumulate(iterable: Iterable[Any], func: Callable[[Any, Any], Any] | None = None, *,
               initial: Any = None) -> Iterator[Any]:
    """accumulate(iterable, func=None, *, initial=None) --> accumulate object"""
    return _accumulate(builtins.iter(iterable), operator.add if func is None else func, initial)


def _accumulate(iterator: Iterator[Any], func: Callable[[Any, Any], Any],
                initial: Any) -> Iterator[Any]:
    total = initial
    if initial is None:
        try:
            total = next(iterator)
        except StopIteration:
            return
    yield total
    for element in iterator:
        total = func(total, element)
        yield total


def count(start: Any = 0, step: Any = 1) -> Iterator[Any]:
    """count(start=0, step=1) --> count object"""
    if not isinstance(start, numbers.Number) or not isinstance(step, numbers.Number):
        raise TypeError("a number is required")
    return _count(start, step)


def _count(value: Any, step: Any) -> Iterator[Any]:
    while True:
        yield value
        value = value + step


def iter(obj: Any, *sentinel: Any) -> Iterator[Any]:  # noqa: A001 - scripts' builtin iter
    """iter(iterable) -> iterator
    iter(callable, sentinel) -> iterator"""
    if not sentinel:
        return builtins.iter(obj)
    if len(sentinel) > 1:
        raise TypeError(f"iter expected at most 2 arguments, got {len(sentinel) + 1}")
    if not callable(obj):
        raise TypeError("iter(v, w): v must be callable")
    return _call_iter(obj, sentinel[0])


def _call_iter(function: Callable[[], Any], sentinel: Any) -> Iterator[Any]:
    while True:
        value = function()
        if value is sentinel or sentinel == value:
            return
        yield value


#: What scripts get in ``itertools`` in place of the C originals.
ITERTOOLS = {"chain": chain, "islice": islice, "cycle": cycle, "pairwise": pairwise,
             "accumulate": accumulate, "count": count}
