"""Library functions read from a class check what they are called on.

A method written in Python and read from its class (``collections.Counter.copy``,
``random.Random.setstate``), not from an instance, is a plain function: a
script could call it on any object and have library code do what the guards
refuse to the script itself. ``Counter.copy(int)`` ran ``self.__class__(self)``
and returned the real ``type`` (three-argument ``type()`` again: classes with
a script-written ``__str__``, refused bases); ``Random.setstate(Counter, ...)``
set an attribute of a library class, which outlived the request and reopened
CPython gh-118492 through ``type.__setattr__`` (a worker crash; red team,
session 35). Such a function is handed out wrapped: its first argument must be
an instance of the class it was read from (a script's subclass included). The
script's own functions, static methods and anything read from an instance
(bound methods) are unchanged. The other routes to such a function found by
the reviews of that fix are closed here too: a library property's ``fget``
(`property_function`) and ``classmethod`` of something not a function
(`script_classmethod`).
"""
from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any


def _found_in(mro: tuple[type, ...], name: str) -> tuple[type | None, Any]:
    """The class along ``mro`` that holds ``name``, and what it holds."""
    for klass in mro:
        if name in klass.__dict__:
            return klass, klass.__dict__[name]
    return None, None


def checked(holder: Any, name: str, func: Callable[..., Any],
            script_type: type) -> Callable[..., Any]:
    """``func``, read as ``holder.name`` (a class or a ``super`` object), made to
    refuse a first argument that is not an instance of that class. What a
    script's own class holds (``class C: encode = json.dumps``) is the script's
    and unchanged: it was handed out checked where the script got it."""
    if isinstance(holder, type):
        owner, mro = holder, holder.__mro__
    else:
        owner = holder.__self_class__
        if owner is None:
            raise TypeError(f"{name}() cannot be read from an unbound super object")
        mro = owner.__mro__
        mro = mro[mro.index(holder.__thisclass__) + 1:]
    klass, raw = _found_in(mro, name)
    if isinstance(raw, staticmethod) or isinstance(klass, script_type):
        return func

    def call(*args: Any, **kwargs: Any) -> Any:
        if not args or not isinstance(args[0], owner):
            raise TypeError(f"{owner.__name__}.{name}() must be called on a "
                            f"{owner.__name__} object")
        return func(*args, **kwargs)
    call.__name__ = call.__qualname__ = name
    call.__doc__ = func.__doc__
    return call


def property_function(prop: property, name: str,
                      is_script_function: Callable[[Any], bool]) -> Any:
    """``prop.fget`` (``fset``, ``fdel``) for a script: its own functions only. A
    library property's is a raw function, callable on anything: a review,
    session 35, called ``ChainMap.parents``' getter on a script class whose
    ``maps`` it had set, which ran ``ScriptType(name, bases, dict)`` with a
    ``__str__`` of its own (``ScriptType`` now refuses such names too)."""
    value = getattr(prop, name)
    if value is None or is_script_function(value):
        return value
    raise AttributeError(f'"{name}" of a library property is not available')


def script_classmethod(function: Any) -> classmethod:  # type: ignore[type-arg]
    """``classmethod`` for scripts: of a function only. CPython 3.11's chains to
    what it wraps, so ``classmethod(collections.ChainMap.parents)`` ran a
    library property's getter on the script's class (a review, session 35:
    ``type(cls)(name, bases, dict)`` with a namespace of the script's)."""
    if type(function) is not types.FunctionType:
        raise TypeError("classmethod() takes a function here")
    return classmethod(function)
